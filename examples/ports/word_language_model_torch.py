"""pytorch/examples ``word_language_model/main.py`` (+ ``model.py``), shrunk to seconds.

The default path of the original: an RNN language model trained by hand-written SGD
(``p.data.add_(p.grad, alpha=-lr)``) after ``clip_grad_norm_(model.parameters(), 0.25)``,
the hidden state carried across batches (``repackage_hidden``), and the learning rate
annealed by ``lr /= 4.0`` whenever the validation loss stops improving.

Changed from the original: a 2-layer ``RNN_TANH`` with 8 units (the LSTM variants are
the same optimizer code), a generated token stream instead of Wikitext-2, tiny batch
and ``bptt`` sizes, no model files, ``--double`` for float64, and ``main`` returns the
per-batch losses, the validation losses, the learning rates and the final weights.
"""

from __future__ import annotations

import argparse
import math

import synthetic
import torch
import torch.nn as nn
import torch.nn.functional as F


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super(RNNModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
        self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def parse(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch RNN Language Model (shrunk)")
    parser.add_argument("--model", type=str, default="RNN_TANH")
    parser.add_argument("--ntokens", type=int, default=12)
    parser.add_argument("--emsize", type=int, default=8)
    parser.add_argument("--nhid", type=int, default=8)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=20, help="initial learning rate")
    parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
    parser.add_argument("--epochs", type=int, default=4, help="upper epoch limit")
    parser.add_argument("--batch_size", type=int, default=4, metavar="N", help="batch size")
    parser.add_argument("--bptt", type=int, default=6, help="sequence length")
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1111, help="random seed")
    parser.add_argument("--n-tokens-train", type=int, default=124)
    parser.add_argument("--double", action="store_true", help="float64 throughout")
    return parser.parse_args(argv)


eval_batch_size = 2


def corpus(args):
    """train, valid and test token streams (the original's ``data.Corpus``)."""
    # sizes with full bptt windows only: one compiled shape per side
    stream = synthetic.tokens(args.n_tokens_train + 100, args.ntokens, seed=args.seed)
    n = args.n_tokens_train
    return stream[:n], stream[n : n + 50], stream[n + 50 :]


def batchify(data, bsz):
    # Work out how cleanly we can divide the dataset into bsz parts.
    nbatch = data.size(0) // bsz
    # Trim off any extra elements that wouldn't cleanly fit (remainders).
    data = data.narrow(0, 0, nbatch * bsz)
    # Evenly divide the data across the bsz batches.
    data = data.view(bsz, -1).t().contiguous()
    return data


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def main(argv=None):
    args = parse(argv)
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    # Set the random seed manually for reproducibility.
    torch.manual_seed(args.seed)
    train_stream, valid_stream, _ = corpus(args)
    train_data = batchify(torch.from_numpy(train_stream), args.batch_size)
    val_data = batchify(torch.from_numpy(valid_stream), eval_batch_size)
    ntokens = args.ntokens
    model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
    criterion = nn.NLLLoss()

    def get_batch(source, i):
        seq_len = min(args.bptt, len(source) - 1 - i)
        data = source[i : i + seq_len]
        target = source[i + 1 : i + 1 + seq_len].view(-1)
        return data, target

    def evaluate(data_source):
        # Turn on evaluation mode which disables dropout.
        model.eval()
        total_loss = 0.0
        hidden = model.init_hidden(eval_batch_size)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, args.bptt):
                data, targets = get_batch(data_source, i)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    losses = []

    def train():
        # Turn on training mode which enables dropout.
        model.train()
        hidden = model.init_hidden(args.batch_size)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
            data, targets = get_batch(train_data, i)
            # Starting each batch, we detach the hidden state from how it was previously produced.
            # If we didn't, the model would try backpropagating all the way to start of the dataset.
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()

            # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            losses.append(loss.item())

    # Loop over epochs.
    lr = args.lr
    best_val_loss = None
    val_losses, lrs = [], []
    for epoch in range(1, args.epochs + 1):
        train()
        val_loss = evaluate(val_data)
        print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}")
        val_losses.append(val_loss)
        # Save the model if the validation loss is the best we've seen so far.
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            # Anneal the learning rate if no improvement has been seen in the validation dataset.
            lr /= 4.0
        lrs.append(lr)
    torch.set_default_dtype(torch.float32)
    return {"losses": losses, "val_losses": val_losses, "lrs": lrs, "params": dict(model.named_parameters())}


if __name__ == "__main__":
    main()
