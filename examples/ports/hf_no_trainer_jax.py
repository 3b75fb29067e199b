"""The JAX port of ``hf_no_trainer_torch.py``: facade AdamW over two groups, ``LambdaLR``
with transformers' lambda verbatim, ``loss / k`` accumulation, ``clip_grad_norm_(1.0)``.

Line for line: the two groups are ``group_by`` rules on the parameters' dotted names
(the same ``any(nd in n for nd in no_decay)`` test, in the same order);
``torch.optim.AdamW(groups, lr=...)`` -> ``functorch_optim.optim.AdamW``;
``get_linear_schedule_with_warmup`` is the same function (it builds the facade's
``LambdaLR``, which calls ``lr_lambda`` with a Python int, as torch does);
``(loss / k).backward()`` -> ``optimizer.backward(loss_fn, ..., k)`` (it adds into
``optimizer.grad``); ``clip_grad_norm_(model.parameters(), 1.0)`` ->
``functorch_optim.nn.utils.clip_grad_norm_(optimizer, 1.0)``.
"""

from __future__ import annotations

import math

import hf_no_trainer_torch as ref
import jax
import jax.numpy as jnp
import jaxnn as F
import synthetic
import torch

from functorch_optim.interop.torch import tree_from_module
from functorch_optim.nn.utils import clip_grad_norm_
from functorch_optim.optim import AdamW, group_by, path_name
from functorch_optim.optim.lr_scheduler import LambdaLR


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    """transformers' ``get_linear_schedule_with_warmup``, verbatim (only ``LambdaLR``'s import differs)."""

    def lr_lambda(current_step: int):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(
            0.0,
            float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)),
        )

    return LambdaLR(optimizer, lr_lambda, last_epoch)


def model(params, input_ids, labels):
    h = jnp.mean(params["embeddings"]["weight"][input_ids], axis=1)
    h = F.layer_norm(params["LayerNorm"], jnp.tanh(F.linear(params["dense"], h)))
    logits = F.linear(params["classifier"], h)
    return F.cross_entropy(logits, labels), logits


def loss_fn(params, input_ids, labels, gradient_accumulation_steps):
    loss, _ = model(params, input_ids, labels)
    return loss / gradient_accumulation_steps, loss


def main(argv=None):
    args = ref.parse(argv)
    if args.double:
        jax.config.update("jax_enable_x64", True)
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    torch.manual_seed(args.seed)
    params = tree_from_module(ref.TinyBertForSequenceClassification())  # the torch model's initial weights
    torch.set_default_dtype(torch.float32)
    input_ids, labels = ref.dataset(args)
    n_batches = len(range(0, len(input_ids), args.per_device_train_batch_size))

    # Optimizer
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight"]

    def decayed(path, p):
        return not any(nd in path_name(path) for nd in no_decay)

    optimizer_grouped_parameters = group_by(
        params,
        {"where": decayed, "weight_decay": args.weight_decay},
        {"where": lambda path, p: not decayed(path, p), "weight_decay": 0.0},
    )
    optimizer = AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    # Scheduler and math around the number of training steps.
    num_update_steps_per_epoch = math.ceil(n_batches / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=args.num_warmup_steps, num_training_steps=max_train_steps
    )

    losses, lrs, completed_steps = [], [], 0
    for epoch in range(args.num_train_epochs):
        batches = synthetic.batches(input_ids, labels, args.per_device_train_batch_size)
        for step, (ids, y) in enumerate(batches):
            _, loss = optimizer.backward(loss_fn, ids, y, args.gradient_accumulation_steps, has_aux=True)
            losses.append(float(loss))
            if step % args.gradient_accumulation_steps == 0 or step == n_batches - 1:
                clip_grad_norm_(optimizer, args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                lrs.append(lr_scheduler.get_last_lr())
        print(f"epoch {epoch}: loss {losses[-1]:.4f} lr {lrs[-1]}")
    return {"losses": losses, "lrs": lrs, "params": optimizer.params}


if __name__ == "__main__":
    main()
