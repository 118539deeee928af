"""timm's architectures for ``aotdist zoo --source timm``: tiny random-weight builds.

:func:`timm_family` builds ``timm.create_model(arch)`` with 10 classes and stochastic depth
on (timm's usual training setting) at a small input; :data:`TIMM_MODELS` lists the
architectures the sweep checks, each at the smallest size it builds at
(``docs/models-timm-torchtitan.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from aotdist.check.families import Family, classification_loss


def timm_family(
    arch: str,
    kind: str = "timm model",
    *,
    size: int | None = None,
    batch: int = 2,
    img_size: bool = True,
    notes: str = "",
    **kwargs: Any,
) -> Family:
    """A ``timm.create_model(arch)`` with random weights, 10 classes and stochastic depth
    on (``drop_path_rate=0.1``, timm's usual training setting, where the architecture has
    it), in train mode; ``kwargs``
    shrink it where timm takes them (``depth``, ``embed_dim``). The batch is ``batch``
    random images of ``size`` pixels square, passed as ``img_size`` where the
    architecture takes one (``img_size``), else its default input size."""

    def build(seed: int):
        import timm

        torch.manual_seed(seed)
        args = {"pretrained": False, "num_classes": 10, "drop_path_rate": 0.1, **kwargs}
        if size is not None and img_size:
            args["img_size"] = size
        try:
            model = timm.create_model(arch, **args)
        except TypeError as exc:  # an architecture without stochastic depth (GhostNet)
            if "drop_path_rate" not in str(exc):
                raise
            del args["drop_path_rate"]
            model = timm.create_model(arch, **args)
        model.train()
        shape = (
            (3, size, size)
            if size is not None
            else tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
        )
        g = torch.Generator().manual_seed(seed + 1)
        return model, {"x": torch.randn(batch, *shape, generator=g)}

    return Family(arch, kind, build, "timm", notes, loss=classification_loss)


# timm's families, each at the smallest size it builds at: a transformer at 64 pixels (its
# own img_size, fewer blocks where it takes depth), a BatchNorm network on 4 images of 64.
_VIT = {"size": 64, "depth": 4}
_CNN = {"size": 64, "batch": 4, "img_size": False}
TIMM_MODELS: tuple[Family, ...] = (
    timm_family("vit_tiny_patch16_224", "ViT", **_VIT),
    timm_family("vit_small_patch16_224", "ViT", **_VIT),
    timm_family("vit_relpos_small_patch16_224", "ViT, relative positions", **_VIT),
    timm_family("deit_tiny_patch16_224", "DeiT", **_VIT),
    timm_family("deit_tiny_distilled_patch16_224", "DeiT, distillation token", **_VIT),
    timm_family("deit3_small_patch16_224", "DeiT III, layer scale", **_VIT),
    timm_family("beit_base_patch16_224", "BEiT", embed_dim=192, num_heads=3, **_VIT),
    timm_family("beitv2_base_patch16_224", "BEiT v2", embed_dim=192, num_heads=3, **_VIT),
    timm_family("eva02_tiny_patch14_224", "EVA-02, rotary, SwiGLU", size=56, depth=4),
    timm_family("flexivit_small", "FlexiViT", size=64, depth=4),
    timm_family("cait_xxs24_224", "CaiT, class attention", **_VIT),
    timm_family("xcit_nano_12_p16_224", "XCiT, cross-covariance attention", **_VIT),
    timm_family("pit_ti_224", "PiT, pooling", size=64),
    timm_family("convit_tiny", "ConViT, gated positional attention", **_VIT),
    timm_family("swin_tiny_patch4_window7_224", "Swin", size=64, window_size=2),
    timm_family("swinv2_tiny_window8_256", "Swin v2", size=64, window_size=2),
    timm_family("levit_128s", "LeViT, attention with BatchNorm", size=64, batch=4),
    timm_family("levit_conv_128s", "LeViT, convolutional", size=64, batch=4),
    timm_family("pvt_v2_b0", "PVT-v2, spatial-reduction attention", size=64, img_size=False),
    timm_family("twins_svt_small", "Twins, local/global attention", size=64),
    timm_family("maxvit_nano_rw_256", "MaxViT, BatchNormAct2d", size=64, batch=4),
    timm_family("maxvit_rmlp_pico_rw_256", "MaxViT, relative-position MLP", size=64, batch=4),
    timm_family("coatnet_nano_rw_224", "CoAtNet, BatchNormAct2d", size=64, batch=4),
    timm_family("coatnet_0_rw_224", "CoAtNet, BatchNormAct2d", size=64, batch=4),
    timm_family("fastvit_t8", "FastViT, reparameterizable", **_CNN),
    timm_family("mobilevit_xxs", "MobileViT, BatchNormAct2d", **_CNN),
    timm_family("mobilevitv2_050", "MobileViT v2", **_CNN),
    timm_family("convnext_atto", "ConvNeXt", **_CNN),
    timm_family("convnextv2_atto", "ConvNeXt v2, GRN", **_CNN),
    timm_family("poolformer_s12", "PoolFormer (MetaFormer)", **_CNN),
    timm_family("poolformerv2_s12", "PoolFormer v2 (MetaFormer)", **_CNN),
    timm_family("edgenext_xx_small", "EdgeNeXt", **_CNN),
    timm_family("efficientformerv2_s0", "EfficientFormer v2", size=64, batch=4),
    timm_family("efficientnet_b0", "EfficientNet, BatchNormAct2d", **_CNN),
    timm_family("efficientnetv2_rw_t", "EfficientNet v2, BatchNormAct2d", **_CNN),
    timm_family("tf_efficientnet_lite0", "EfficientNet-Lite, same padding", **_CNN),
    timm_family("mixnet_s", "MixNet, mixed kernels", **_CNN),
    timm_family("mobilenetv3_small_050", "MobileNetV3, hard-swish", **_CNN),
    timm_family("mobilenetv3_large_100", "MobileNetV3", **_CNN),
    timm_family("regnetx_002", "RegNetX, BatchNormAct2d", **_CNN),
    timm_family("regnety_002", "RegNetY, squeeze-excitation", **_CNN),
    timm_family("resnet18", "ResNet", **_CNN),
    timm_family("resnet50d", "ResNet-D, bottleneck", **_CNN),
    timm_family("resnext26ts", "ResNeXt (ByobNet)", **_CNN),
    timm_family("ghostnet_100", "GhostNet", **_CNN),
    timm_family("repvgg_a0", "RepVGG", **_CNN),
    timm_family("mambaout_femto", "MambaOut, gated CNN", **_CNN),
    timm_family("inception_next_atto", "InceptionNeXt", **_CNN),
)
