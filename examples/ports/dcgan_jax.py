"""The JAX port of ``dcgan_torch.py``: two facade Adams, ``backward(..., has_aux=True)`` for D(x).

Line for line: each ``optim.Adam`` -> ``functorch_optim.optim.Adam``; ``netD.zero_grad()``
-> ``optimizerD.zero_grad()``; the two ``backward()`` calls of the discriminator's step
add into ``optimizerD.grad`` as torch's add into ``.grad``; ``fake.detach()`` is passing
the generated images as an input (not a function of ``optimizerD``'s parameters); the
diagnostics ``D(x)``, ``D(G(z))`` come back from the same forward pass as the loss
(``has_aux=True``). The weights start equal to the torch models' (``interop.torch``).
"""

from __future__ import annotations

import dcgan_torch
import jax
import jax.numpy as jnp
import jaxnn as F
import numpy as np
import synthetic
import torch

from functorch_optim.interop.torch import tree_from_module
from functorch_optim.optim import Adam


def netG(params, z):
    p = params["main"]
    x = z
    for i, stride, pad in ((0, 1, 0), (3, 2, 1), (6, 2, 1), (9, 2, 1)):
        x = F.conv_transpose2d(p[str(i)], x, stride, pad)
        x = jax.nn.relu(F.batch_norm(p[str(i + 1)], x))
    return jnp.tanh(F.conv_transpose2d(p["12"], x, 2, 1))


def netD(params, x):
    p = params["main"]
    x = jax.nn.leaky_relu(F.conv2d(p["0"], x, 2, 1), 0.2)
    for i in (2, 5, 8):
        x = jax.nn.leaky_relu(F.batch_norm(p[str(i + 1)], F.conv2d(p[str(i)], x, 2, 1)), 0.2)
    return jax.nn.sigmoid(F.conv2d(p["11"], x, 1, 0)).reshape(-1)


def d_loss(d_params, images, label):
    output = netD(d_params, images)
    return F.bce_loss(output, label), jnp.mean(output)


def g_loss(g_params, d_params, noise, label):
    output = netD(d_params, netG(g_params, noise))
    return F.bce_loss(output, label), jnp.mean(output)


def main(argv=None):
    opt = dcgan_torch.parse(argv)
    if opt.double:
        jax.config.update("jax_enable_x64", True)
    dtype = np.float64 if opt.double else np.float32
    torch.set_default_dtype(torch.float64 if opt.double else torch.float32)
    torch_g, torch_d = dcgan_torch.models(opt)  # the torch models' initial weights
    torch.set_default_dtype(torch.float32)
    images, noises = dcgan_torch.data(opt)

    real_label = 1
    fake_label = 0

    # setup optimizer
    optimizerD = Adam(tree_from_module(torch_d), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = Adam(tree_from_module(torch_g), lr=opt.lr, betas=(opt.beta1, 0.999))

    losses, it = [], 0
    n_batches = len(range(0, opt.n_images, opt.batchSize))
    for epoch in range(opt.niter):
        for i, (real, _) in enumerate(synthetic.batches(images.astype(dtype), images, opt.batchSize)):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            optimizerD.zero_grad()
            label = np.full((real.shape[0],), real_label, dtype)
            errD_real, D_x = optimizerD.backward(d_loss, real, label, has_aux=True)

            noise = noises[it].astype(dtype)
            it += 1
            fake = jax.jit(netG)(optimizerG.params, noise)
            label = np.full((real.shape[0],), fake_label, dtype)
            errD_fake, D_G_z1 = optimizerD.backward(d_loss, fake, label, has_aux=True)
            errD = errD_real + errD_fake
            optimizerD.step()

            # (2) Update G network: maximize log(D(G(z)))
            optimizerG.zero_grad()
            label = np.full((real.shape[0],), real_label, dtype)  # fake labels are real for generator cost
            errG, D_G_z2 = optimizerG.backward(g_loss, optimizerD.params, noise, label, has_aux=True)
            optimizerG.step()

            print(
                "[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
                % (epoch, opt.niter, i, n_batches, errD, errG, D_x, D_G_z1, D_G_z2)
            )
            losses.append(tuple(float(v) for v in (errD, errG, D_x, D_G_z1, D_G_z2)))
    return {"losses": losses, "params": {"netD": optimizerD.params, "netG": optimizerG.params}}


if __name__ == "__main__":
    main()
