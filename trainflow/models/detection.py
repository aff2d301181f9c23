"""RetinaNet from torchvision on a small backbone, sized for small images, and its export form.

`retinanet_resnet50_fpn` expects ~800 px images and objects of 32-512 px. Here images are
small (64-256 px) and objects a fraction of them, so the backbone is either a compact CNN
(`tiny`, trains in minutes on a CPU) or a torchvision ResNet (`resnet18`, `resnet50`), always
built without pretrained weights, with an FPN over strides 4, 8 and 16 and anchors scaled to
the image. The images are not resized (`min_size = max_size = image_size`).
"""

from collections import OrderedDict
from typing import Literal

import torch
from torch import Tensor, nn
from torchvision.models.detection import RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.ops import FeaturePyramidNetwork

Backbone = Literal["tiny", "resnet18", "resnet50"]
# The head sees the stride 4, 8 and 16 maps (P2-P4): objects here are a fifth to a half of
# the image, and the coarser P5-P7 of the original RetinaNet would give a 64 px image maps of
# 2 x 2 cells and less. Anchor sides are a share of the image (12, 24 and 48 px at 64 px),
# each at three scales and three aspect ratios, as in the original.
_ANCHOR_SHARE = (3 / 16, 3 / 8, 3 / 4)
_SCALES = (1.0, 2 ** (1 / 3), 2 ** (2 / 3))
_ASPECT_RATIOS = (0.5, 1.0, 2.0)


def _conv(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class _TinyStages(nn.Module):
    """Four stride-2 conv stages; returns the stride 4, 8 and 16 maps (48, 64, 96 channels)."""

    channels = (48, 64, 96)

    def __init__(self) -> None:
        super().__init__()
        self.c2 = nn.Sequential(_conv(3, 32, 2), _conv(32, 48, 2), _conv(48, 48, 1))
        self.c3 = nn.Sequential(_conv(48, 64, 2), _conv(64, 64, 1))
        self.c4 = nn.Sequential(_conv(64, 96, 2), _conv(96, 96, 1))

    def forward(self, x: Tensor) -> list[Tensor]:
        c2 = self.c2(x)
        c3 = self.c3(c2)
        return [c2, c3, self.c4(c3)]


class _ResNetStages(nn.Module):
    """A torchvision ResNet up to `layer3`; returns its stride 4, 8 and 16 maps."""

    def __init__(self, name: Literal["resnet18", "resnet50"]) -> None:
        super().__init__()
        from torchvision import models

        net = getattr(models, name)(weights=None)
        self.c2 = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1)
        self.c3, self.c4 = net.layer2, net.layer3
        width = 64 if name == "resnet18" else 256
        self.channels = (width, 2 * width, 4 * width)

    def forward(self, x: Tensor) -> list[Tensor]:
        c2 = self.c2(x)
        c3 = self.c3(c2)
        return [c2, c3, self.c4(c3)]


class PyramidBackbone(nn.Module):
    """Stages + FPN: the `out_channels`-wide P2-P4 maps RetinaNet's head runs on."""

    def __init__(self, backbone: Backbone, out_channels: int) -> None:
        super().__init__()
        self.body = _TinyStages() if backbone == "tiny" else _ResNetStages(backbone)
        self.fpn = FeaturePyramidNetwork(list(self.body.channels), out_channels)
        self.out_channels = out_channels

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        features = self.body(x)
        return self.fpn(OrderedDict((f"p{i + 2}", f) for i, f in enumerate(features)))


def anchor_sizes(image_size: int) -> tuple[tuple[float, ...], ...]:
    """Anchor sides per pyramid level (three scales each) for square images of `image_size`."""
    return tuple(tuple(image_size * share * scale for scale in _SCALES) for share in _ANCHOR_SHARE)


def build_retinanet(
    num_classes: int,
    image_size: int,
    backbone: Backbone = "tiny",
    fpn_channels: int = 64,
    detections_per_image: int = 100,
) -> RetinaNet:
    """A freshly initialised RetinaNet for square `image_size` images and `num_classes` classes.

    Labels are `0..num_classes-1` (RetinaNet's sigmoid focal loss needs no background class).
    """
    sizes = anchor_sizes(image_size)
    return RetinaNet(
        PyramidBackbone(backbone, fpn_channels),
        num_classes=num_classes,
        min_size=image_size,
        max_size=image_size,
        anchor_generator=AnchorGenerator(sizes, (_ASPECT_RATIOS,) * len(sizes)),
        detections_per_img=detections_per_image,
    )


class BoxPredictor(nn.Module):
    """The registered form: a batch of images in, a fixed-shape tensor of detections out.

    MLflow's `pytorch` flavor (and its pyfunc) passes one tensor in and wants one tensor out;
    RetinaNet takes a list of images and returns a list of dicts. Input: N x 3 x H x W floats
    in [0, 1]. Output: N x `detections_per_image` x 6 rows `(x1, y1, x2, y2, score, label)`,
    best first, padded with rows of -1.
    """

    def __init__(self, detector: RetinaNet) -> None:
        super().__init__()
        self.detector = detector.eval()

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        found = self.detector(list(images))
        limit = self.detector.detections_per_img
        out = torch.full((len(found), limit, 6), -1.0, device=images.device)
        for i, d in enumerate(found):
            rows = torch.cat([d["boxes"], d["scores"][:, None], d["labels"][:, None].float()], 1)
            out[i, : len(rows)] = rows[:limit]
        return out
