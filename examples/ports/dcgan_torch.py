"""pytorch/examples ``dcgan/main.py``, shrunk to seconds: two Adams, a generator and a discriminator.

Changed from the original: tiny widths (``nz=4``, ``ngf=ndf=2``, one channel), generated
64x64 images instead of a dataset, the noise drawn from a seeded NumPy generator (so the
JAX port draws the same), no image or checkpoint files, ``--double`` for float64, and
``main`` returns the per-iteration losses (``Loss_D``, ``Loss_G``) and the final weights.
The architecture, ``weights_init``, the loss and the update order are the original's.
"""

from __future__ import annotations

import argparse

import numpy as np
import synthetic
import torch
import torch.nn as nn
import torch.optim as optim


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batchSize", type=int, default=4, help="input batch size")
    parser.add_argument("--imageSize", type=int, default=64, help="the height / width of the input image")
    parser.add_argument("--nz", type=int, default=4, help="size of the latent z vector")
    parser.add_argument("--ngf", type=int, default=2)
    parser.add_argument("--ndf", type=int, default=2)
    parser.add_argument("--niter", type=int, default=1, help="number of epochs to train for")
    parser.add_argument("--n-images", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate, default=0.0002")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam. default=0.5")
    parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
    parser.add_argument("--double", action="store_true", help="float64 throughout")
    return parser.parse_args(argv)


# custom weights initialization called on netG and netD
def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc):
        super(Generator, self).__init__()
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            # state size. (ngf*8) x 4 x 4
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 8 x 8
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 16 x 16
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            # state size. (ngf) x 32 x 32
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
            # state size. (nc) x 64 x 64
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc):
        super(Discriminator, self).__init__()
        self.main = nn.Sequential(
            # input is (nc) x 64 x 64
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 32 x 32
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 16 x 16
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*4) x 8 x 8
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*8) x 4 x 4
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def models(opt, nc=1):
    """Both networks, initialised as the original does (seeded)."""
    torch.manual_seed(opt.manualSeed)
    netG = Generator(opt.nz, opt.ngf, nc)
    netG.apply(weights_init)
    netD = Discriminator(opt.ndf, nc)
    netD.apply(weights_init)
    return netG, netD


def data(opt):
    """The images, in [-1, 1] like the original's normalised ones, and one noise batch per iteration."""
    x, _ = synthetic.images(opt.n_images, opt.imageSize, seed=opt.manualSeed)
    images = np.tanh(x)
    rng = np.random.default_rng(opt.manualSeed)
    n_iter = opt.niter * len(range(0, opt.n_images, opt.batchSize))
    noise = [rng.standard_normal((opt.batchSize, opt.nz, 1, 1)) for _ in range(n_iter)]
    return images, noise


def main(argv=None):
    opt = parse(argv)
    torch.set_default_dtype(torch.float64 if opt.double else torch.float32)
    dtype = torch.get_default_dtype()
    netG, netD = models(opt)
    images, noises = data(opt)
    dataloader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(images).to(dtype)), batch_size=opt.batchSize
    )

    criterion = nn.BCELoss()

    real_label = 1
    fake_label = 0

    # setup optimizer
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    losses, it = [], 0
    for epoch in range(opt.niter):
        for i, data_ in enumerate(dataloader, 0):
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            # train with real
            netD.zero_grad()
            real_cpu = data_[0]
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)

            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()

            # train with fake
            noise = torch.from_numpy(noises[it]).to(dtype)
            it += 1
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()

            print(
                "[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
                % (epoch, opt.niter, i, len(dataloader), errD.item(), errG.item(), D_x, D_G_z1, D_G_z2)
            )
            losses.append((errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
    torch.set_default_dtype(torch.float32)
    params = {
        **{"netD." + k: v for k, v in netD.named_parameters()},
        **{"netG." + k: v for k, v in netG.named_parameters()},
    }
    return {"losses": losses, "params": params}


if __name__ == "__main__":
    main()
