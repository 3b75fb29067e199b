"""The JAX port of ``word_language_model_torch.py``: facade SGD, ``clip_grad_norm_``, ``lr /= 4.0``.

Line for line: the hand-written ``p.data.add_(p.grad, alpha=-lr)`` is plain
``functorch_optim.optim.SGD`` (torch's SGD step without momentum is exactly that line),
with ``optimizer.param_groups[0]["lr"] = lr`` following the annealed Python ``lr``;
``torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)`` ->
``functorch_optim.nn.utils.clip_grad_norm_(optimizer, args.clip)``; the hidden state
comes back from the same forward pass as the loss (``backward(..., has_aux=True)``), and
``repackage_hidden`` is passing it in as an input. The weights start equal.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jaxnn as F
import numpy as np
import torch
import word_language_model_torch as ref

from functorch_optim.interop.torch import tree_from_module
from functorch_optim.nn.utils import clip_grad_norm_
from functorch_optim.optim import SGD

eval_batch_size = ref.eval_batch_size


def rnn(p, emb, hidden):
    """``nn.RNN(nonlinearity="tanh")`` over ``(seq, batch, features)``, layer by layer."""
    out, last = emb, []
    for layer in range(hidden.shape[0]):
        ih = {"weight": p[f"weight_ih_l{layer}"], "bias": p[f"bias_ih_l{layer}"]}
        hh = {"weight": p[f"weight_hh_l{layer}"], "bias": p[f"bias_hh_l{layer}"]}

        def cell(h, x, ih=ih, hh=hh):
            h = jnp.tanh(F.linear(ih, x) + F.linear(hh, h))
            return h, h

        h, out = jax.lax.scan(cell, hidden[layer], out)
        last.append(h)
    return out, jnp.stack(last)


def model(params, data, hidden):
    emb = params["encoder"]["weight"][data]
    output, hidden = rnn(params["rnn"], emb, hidden)
    decoded = F.linear(params["decoder"], output)
    return F.log_softmax(decoded.reshape(-1, decoded.shape[-1]), axis=1), hidden


def loss_fn(params, data, targets, hidden):
    output, hidden = model(params, data, hidden)
    return F.nll_loss(output, targets), hidden


def batchify(data, bsz):
    nbatch = data.shape[0] // bsz
    return data[: nbatch * bsz].reshape(bsz, -1).T


def main(argv=None):
    args = ref.parse(argv)
    if args.double:
        jax.config.update("jax_enable_x64", True)
    dtype = np.float64 if args.double else np.float32
    torch.set_default_dtype(torch.float64 if args.double else torch.float32)
    torch.manual_seed(args.seed)
    torch_model = ref.RNNModel(args.model, args.ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
    params = tree_from_module(torch_model)  # the torch model's initial weights
    torch.set_default_dtype(torch.float32)
    train_stream, valid_stream, _ = ref.corpus(args)
    train_data = batchify(train_stream, args.batch_size)
    val_data = batchify(valid_stream, eval_batch_size)

    def init_hidden(bsz):
        return np.zeros((args.nlayers, bsz, args.nhid), dtype)

    def get_batch(source, i):
        seq_len = min(args.bptt, len(source) - 1 - i)
        data = source[i : i + seq_len]
        target = source[i + 1 : i + 1 + seq_len].reshape(-1)
        return data, target

    eval_loss = jax.jit(loss_fn)

    def evaluate(data_source):
        total_loss = 0.0
        hidden = init_hidden(eval_batch_size)
        for i in range(0, data_source.shape[0] - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            loss, hidden = eval_loss(optimizer.params, data, targets, hidden)
            total_loss += len(data) * float(loss)
        return total_loss / (len(data_source) - 1)

    losses = []
    optimizer = SGD(params, lr=args.lr)

    def train():
        hidden = init_hidden(args.batch_size)
        optimizer.param_groups[0]["lr"] = lr
        for batch, i in enumerate(range(0, train_data.shape[0] - 1, args.bptt)):
            data, targets = get_batch(train_data, i)
            optimizer.zero_grad()
            loss, hidden = optimizer.backward(loss_fn, data, targets, hidden, has_aux=True)

            # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
            clip_grad_norm_(optimizer, args.clip)
            optimizer.step()
            losses.append(float(loss))

    # Loop over epochs.
    lr = args.lr
    best_val_loss = None
    val_losses, lrs = [], []
    for epoch in range(1, args.epochs + 1):
        train()
        val_loss = evaluate(val_data)
        print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}")
        val_losses.append(val_loss)
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            # Anneal the learning rate if no improvement has been seen in the validation dataset.
            lr /= 4.0
        lrs.append(lr)
    return {"losses": losses, "val_losses": val_losses, "lrs": lrs, "params": optimizer.params}


if __name__ == "__main__":
    main()
