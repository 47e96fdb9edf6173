"""The modules aotbuild exports for a VAE's decoder and encoder parts, and their example inputs
for calls the text-to-image pipeline does not make (encoding, tiles). Imported when a VAE part is
built, not when a pipeline's spec is read (`pipelines._vae_part`)."""

from __future__ import annotations

import torch

from .pipelines import FRAMEWISE_VAES, CallInputs, vae_factor


class VaeDecoderModule(torch.nn.Module):
    """What `AutoencoderKL` (and FLUX.2's `AutoencoderKLFlux2`, the same code) runs per decode (or
    per tile): post-quant conv then decoder.

    Holding only these two submodules keeps the encoder's weights out of the exported program;
    `bn` (`KEPT_MODULES`), where the VAE has one, is held for its statistics, never called.
    """

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.post_quant_conv = getattr(vae, "post_quant_conv", None)
        self.decoder = vae.decoder
        self.bn = getattr(vae, "bn", None)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)


class VaeEncoderModule(torch.nn.Module):
    """What `AutoencoderKL` runs per encode (or per tile): encoder then quant conv, giving the
    moments its `DiagonalGaussianDistribution` is made of."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = vae.encoder
        self.quant_conv = getattr(vae, "quant_conv", None)
        self.bn = getattr(vae, "bn", None)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(images)
        return self.quant_conv(moments) if self.quant_conv is not None else moments


def _one_frame(vae: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """The VAE's input layout: a frame axis of one for the frame-wise causal VAEs (FRAMEWISE_VAES)."""
    return tensor.unsqueeze(2) if type(vae).__name__ in FRAMEWISE_VAES else tensor


def random_latents(vae: torch.nn.Module, batch: int, height: int, width: int,
                    generator: torch.Generator) -> CallInputs:
    factor = vae_factor(vae.config)
    channels = vae.config.get("latent_channels") or vae.config["z_dim"]  # Qwen-Image's names it z_dim
    latents = torch.randn((batch, channels, height // factor, width // factor), generator=generator)
    return (_one_frame(vae, latents),), {}


def random_images(vae: torch.nn.Module, batch: int, height: int, width: int,
                   generator: torch.Generator) -> CallInputs:
    # Pixels in [-1, 1], as the pipelines' image processors hand them to the encoder.
    channels = vae.config.get("in_channels") or vae.config["input_channels"]
    return (_one_frame(vae, torch.rand((batch, channels, height, width), generator=generator) * 2 - 1),), {}
