"""pytorch/examples ``time_sequence_prediction/train.py``, shrunk to seconds: LBFGS with a closure.

Changed from the original: 16 hidden units instead of 51 (an argument), 10 training
waves of length 60 (``generate_sine_wave.py``'s generator, not a saved file), 2 steps,
a 20-step future, no plots, and ``main`` returns the closure's losses, the test losses
and the final weights. The model, the float64 run, ``LBFGS(lr=0.8)`` and the closure are
the original's.
"""

from __future__ import annotations

import argparse

import numpy as np
import synthetic
import torch
import torch.nn as nn
import torch.optim as optim


class Sequence(nn.Module):
    def __init__(self, hidden=51):
        super(Sequence, self).__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        c_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2, help="steps to run")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--waves", type=int, default=13)
    parser.add_argument("--length", type=int, default=60)
    parser.add_argument("--future", type=int, default=20)
    return parser.parse_args(argv)


def model(opt):
    np.random.seed(0)
    torch.manual_seed(0)
    seq = Sequence(opt.hidden)
    seq.double()
    return seq


def main(argv=None):
    opt = parse(argv)
    # set random seed to 0
    seq = model(opt)
    # load data and make training set
    data = synthetic.sine_waves(opt.waves, opt.length)
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    criterion = nn.MSELoss()
    # use LBFGS as optimizer since we can load the whole data to train
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8)
    losses, test_losses = [], []
    # begin to train
    for i in range(opt.steps):
        print("STEP: ", i)

        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss:", loss.item())
            losses.append(loss.item())
            loss.backward()
            return loss

        optimizer.step(closure)
        # begin to predict, no need to track gradient here
        with torch.no_grad():
            future = opt.future
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print("test loss:", loss.item())
            test_losses.append(loss.item())
    return {"losses": losses, "test_losses": test_losses, "params": dict(seq.named_parameters())}


if __name__ == "__main__":
    main()
