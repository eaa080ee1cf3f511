"""Factories for tests/test_real_models.py: real segmentation and detection models, small,
seeded by bnsurgeon, no weights downloaded."""

from __future__ import annotations

SIDE = 64  # detectors resize every image to this (their transform's min/max size)
#: few proposals and detections: the box head's cost is per proposal (1000 per image by default)
FPN_CHANNELS = 32
SMALL_RCNN = {"rpn_pre_nms_top_n_test": 64, "rpn_post_nms_top_n_test": 16, "box_detections_per_img": 10}


def unet_efficientnet():
    """smp's native EfficientNet encoder: its stem is a Conv2d subclass (same padding)."""
    import segmentation_models_pytorch as smp

    return smp.Unet("efficientnet-b0", encoder_weights=None, classes=2)


def deeplabv3plus_timm_universal():
    """smp with a timm-universal encoder: timm BatchNormAct2d inside."""
    import segmentation_models_pytorch as smp

    return smp.DeepLabV3Plus("tu-regnety_002", encoder_weights=None, classes=2)


def deeplabv3():
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    return deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3, aux_loss=False)


def _resnet18_fpn(frozen: bool, returned_layers=(1, 2, 3, 4), extra_blocks=None):
    """resnet18 + a 32-channel FPN (torchvision's layout, narrower so the suite stays fast).

    ``frozen``: FrozenBatchNorm2d everywhere and the stem and layer1 not trainable, as
    torchvision builds a backbone for fine-tuning (trainable_layers=3).
    """
    from torch import nn
    from torchvision.models import resnet18
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.ops.misc import FrozenBatchNorm2d

    body = resnet18(weights=None, norm_layer=FrozenBatchNorm2d if frozen else nn.BatchNorm2d)
    if frozen:
        for name, parameter in body.named_parameters():
            if not name.startswith(("layer2", "layer3", "layer4")):
                parameter.requires_grad_(False)
    return_layers = {f"layer{k}": str(i) for i, k in enumerate(returned_layers)}
    in_channels = [64 * 2 ** (k - 1) for k in returned_layers]
    return BackboneWithFPN(body, return_layers, in_channels, FPN_CHANNELS, extra_blocks=extra_blocks)


def fasterrcnn_frozen():
    """Faster R-CNN as torchvision builds it for fine-tuning: a FrozenBatchNorm2d backbone."""
    from torchvision.models.detection import FasterRCNN

    return FasterRCNN(_resnet18_fpn(True), num_classes=3, min_size=SIDE, max_size=SIDE, **SMALL_RCNN)


def retinanet():
    from torchvision.models.detection import RetinaNet
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    backbone = _resnet18_fpn(False, returned_layers=(2, 3, 4), extra_blocks=LastLevelP6P7(FPN_CHANNELS, FPN_CHANNELS))
    # score_thresh under the focal-loss prior (0.01) so a fresh head returns boxes
    return RetinaNet(
        backbone,
        num_classes=3,
        min_size=SIDE,
        max_size=SIDE,
        score_thresh=0.001,
        topk_candidates=50,
        detections_per_img=10,
    )


def ssdlite():
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    model = ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, topk_candidates=50, detections_per_img=10
    )
    model.transform.fixed_size = (SIDE, SIDE)  # 320 in float64 costs minutes (depthwise convs)
    return model


class DictInput:
    """A model whose forward takes a dict: no input can be inferred for it."""

    def __new__(cls):
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 8, 3)
                self.bn = nn.BatchNorm2d(8)

            def forward(self, batch):
                if not isinstance(batch, dict):
                    raise TypeError("Net takes a dict {'image': ..., 'scale': ...}")
                return self.bn(self.conv(batch["image"])) * batch["scale"][:, :, None, None]

        torch.manual_seed(0)
        return Net()


def dict_input():
    return DictInput()


def train_backbone_two_steps(rank: int, world_size: int, path: str, factory: str, out: str) -> dict:
    """A rank of the frozen round trip: load the unfrozen detector, train its backbone's BN
    for two SGD steps on this rank's images (sync BN over both ranks), rank 0 writes the
    result beside the input with the same bnsurgeon metadata (as a training script would)."""
    import torch
    from safetensors.torch import save_file

    import bnsurgeon
    from bnsurgeon.files.reading import read_checkpoint
    from bnsurgeon.files.writing import unique_tensors

    model = bnsurgeon.load(path, model=factory)
    backbone = model.backbone.train()
    optimizer = torch.optim.SGD([p for p in backbone.parameters() if p.requires_grad], lr=0.01)
    for step in range(2):
        x = torch.randn(4, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(100 + step))[rank * 2 : rank * 2 + 2]
        loss = sum(feature.square().mean() for feature in backbone(x).values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    stats = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("running_mean", "running_var"))}
    if rank == 0:
        tensors, _ = unique_tensors(model)
        save_file(tensors, out, metadata=read_checkpoint(path).metadata)
    return stats


def _mm_net(norm):
    import torch
    from torch import nn

    class Net(nn.Module):
        """A conv BN on 4-d input and a BN on 2-d input: --to plain must tell them apart."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.bn = norm(8)
            self.fc = nn.Linear(8, 6)
            self.bn1d = norm(6)

        def forward(self, x):
            x = torch.relu(self.bn(self.conv(x))).mean((2, 3))
            return self.bn1d(self.fc(x))

    torch.manual_seed(0)
    return Net()


def mmengine_syncbn():
    """What mmseg/mmdet build for norm_cfg=dict(type='SyncBN')."""
    from mmengine.utils.dl_utils.parrots_wrapper import SyncBatchNorm

    return _mm_net(SyncBatchNorm)


def mmengine_reverted():
    """mmengine's revert_sync_batchnorm: dimension-less _BatchNormXd."""
    from mmengine.model.utils import revert_sync_batchnorm
    from torch import nn

    return revert_sync_batchnorm(_mm_net(nn.SyncBatchNorm))


def lightning_reverted():
    """Lightning's TorchSyncBatchNorm().revert: its own _BatchNormXd."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm
    from torch import nn

    return TorchSyncBatchNorm().revert(_mm_net(nn.SyncBatchNorm))
