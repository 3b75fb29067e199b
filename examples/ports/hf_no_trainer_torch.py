"""A Hugging Face ``run_glue_no_trainer.py``-style loop, shrunk to seconds.

What the transformers examples do around the optimizer, verbatim: AdamW over two
parameter groups (no weight decay for biases and ``LayerNorm.weight``), the linear
warmup schedule through ``LambdaLR`` with transformers' own ``lr_lambda``, the loss
divided by ``gradient_accumulation_steps`` and stepped on ``step % k == 0 or last``,
and ``clip_grad_norm_(model.parameters(), 1.0)`` before each step (``max_grad_norm``).

Changed: a tiny BERT-shaped classifier (an embedding, a dense layer, a ``LayerNorm``, a
classifier head) and generated token sequences instead of a pretrained model and GLUE,
no ``accelerate`` (``accelerator.backward(loss)`` is ``loss.backward()`` on one CPU),
``--double`` for float64, and ``main`` returns the per-micro-batch losses, the learning
rates and the final weights.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    """transformers' ``get_linear_schedule_with_warmup``, verbatim."""

    def lr_lambda(current_step: int):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(
            0.0,
            float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)),
        )

    return LambdaLR(optimizer, lr_lambda, last_epoch)


class TinyBertForSequenceClassification(nn.Module):
    def __init__(self, vocab_size=16, hidden_size=8, num_labels=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size)
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, input_ids, labels):
        h = self.embeddings(input_ids).mean(dim=1)
        h = self.LayerNorm(torch.tanh(self.dense(h)))
        logits = self.classifier(h)
        return nn.functional.cross_entropy(logits, labels), logits


def parse(argv=None):
    parser = argparse.ArgumentParser(description="Finetune a text classifier (shrunk)")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--n-examples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--double", action="store_true", help="float64 throughout")
    return parser.parse_args(argv)


def dataset(args):
    rng = np.random.default_rng(args.seed)
    input_ids = rng.integers(0, 16, (args.n_examples, 6))
    labels = (input_ids[:, 0] > 7).astype(np.int64)
    return input_ids, labels


def main(argv=None):
    args = parse(argv)
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    torch.manual_seed(args.seed)
    model = TinyBertForSequenceClassification()
    input_ids, labels = dataset(args)
    train_dataloader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(input_ids), torch.from_numpy(labels)),
        batch_size=args.per_device_train_batch_size,
    )

    # Optimizer
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    # Scheduler and math around the number of training steps.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=args.num_warmup_steps, num_training_steps=max_train_steps
    )

    losses, lrs, completed_steps = [], [], 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, (ids, y) in enumerate(train_dataloader):
            loss, _ = model(ids, y)
            losses.append(loss.item())
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                lrs.append(lr_scheduler.get_last_lr())
        print(f"epoch {epoch}: loss {losses[-1]:.4f} lr {lrs[-1]}")
    torch.set_default_dtype(torch.float32)
    return {"losses": losses, "lrs": lrs, "params": dict(model.named_parameters())}


if __name__ == "__main__":
    main()
