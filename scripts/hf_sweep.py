"""Sweep the Hugging Face transformers model families that use BatchNorm or a frozen-BN class: build each
small, save_pretrained it, and run bnsurgeon's own steps on the directory.

    HF_HUB_OFFLINE=1 python scripts/hf_sweep.py                          # every family found (minutes)
    HF_HUB_OFFLINE=1 python scripts/hf_sweep.py --families detr,resnet --json hf.json
    HF_HUB_OFFLINE=1 python scripts/hf_sweep.py --steps inspect,convert   # the cheap steps alone

Families are found, not listed: every ``transformers/models/*/modeling_*.py`` whose source names
``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` or a ``*FrozenBatchNorm*`` class (a text search: no
module is imported to find them). For each, the model classes of the module's ``__all__`` are tried in
order of preference (image classification, object detection, semantic segmentation, the base model, the
rest) and the first one whose small build holds a BN-family module is swept. Its config is the config
class's defaults shrunk by one generic rule (depths to 1, widths divided by a common factor, so equal
sizes stay equal; see ``shrink``), plus the per-family overrides in ``OVERRIDES`` where that is not
enough, each with its reason. Built with seed 0, saved with ``save_pretrained`` into a temporary
directory, then through bnsurgeon's Python API (the CLI is a thin layer over it):

    inspect  bnsurgeon.inspect(DIR)                                   bnsurgeon inspect DIR
    convert  convert_source(DIR, OUT, to="sync"[, frozen="unfreeze"]) bnsurgeon convert DIR -o OUT [--frozen unfreeze]
    eval/train/ranks  verify(DIR, OUT, world_sizes=(2,))              bnsurgeon verify DIR OUT -w 2
    revert   convert_source(OUT, BACK, to="plain" or "frozen")        bnsurgeon convert OUT --to plain|frozen -o BACK
             (and BACK's tensors must equal the built model's state dict, key for key)
    load     bnsurgeon.load(OUT): no arguments; its class, and its eval outputs against the source's

A step is pass, FAIL (with a one-line reason) or n.a. (with why). A family that cannot be built small
(an external package, a tokenizer, remote weights), or whose built model holds no BN-family module
(the code names BatchNorm only in ``_init_weights``, or behind an option off by default), is
reported as skipped with the reason, never dropped. Each family runs in a worker process in its own
process group; one that exceeds ``--timeout-per-family`` is killed with its rank processes and
recorded as a timeout. The exit code is 1 when a step fails for a reason not in ``KNOWN_FAILURES``,
or a family times out or crashes the worker; 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub: configs are built from their classes, weights are seeded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

STEPS = ("inspect", "convert", "eval", "train", "ranks", "revert", "load")
#: what the modeling source must name for its family to be swept
BN_PATTERN = re.compile(r"\bnn\.(?:Sync)?BatchNorm[123]d\b|\b\w*FrozenBatchNorm\w*")
#: the head classes tried first, then the base model, then whatever else the module exports
PREFERRED_SUFFIXES = (
    "ForImageClassification",
    "ForObjectDetection",
    "ForSemanticSegmentation",
    "ForDepthEstimation",
    "Model",
    "Backbone",
)
#: widths are divided by the first of these at which the model builds and runs (code that rounds channels
#: to a divisor, or hard-codes a group count, needs its widths as they are); then the same with the blocks
#: per stage kept (where a stage's output width is its blocks' concatenation, as in HGNet)
WIDTH_FACTORS = (8, 4, 2, 1)
ATTEMPTS = [(factor, True) for factor in WIDTH_FACTORS] + [(factor, False) for factor in WIDTH_FACTORS]
IMAGE_SIDE = 64
BATCH = 2

#: failures that are known and tracked elsewhere: (pattern of the reason, what it is). They are
#: reported, but do not make the exit code non-zero.
KNOWN_FAILURES = [
    (
        r"outputs are not per sample",
        "outputs not per sample at the model and at every submodule tried (e.g. image pairs flattened into the "
        "batch): verify cannot line ranks up (a limitation, named by verify's own message)",
    ),
]


#: Per family, what the generic shrink and class choice do not get right, each with its reason.
#: "config": merged into the shrunk config dict (sub-configs as nested dicts); "model": the class to
#: build; "input": the check input shape; "skip": why the family is not swept.
def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_TIED_DECODER = {"config": {"decoder_layers": 2}}  # ForObjectDetection ties bbox/class heads of decoder layers
# 1.. to layer 0's (tie_weights_keys): with one decoder layer the tie matches nothing and the build raises
_INTRACLASS = {
    "config": {
        "intraclass_block_config": {  # None by default (the released checkpoints carry it):
            # shape-preserving kernel/stride/padding triples for the block's 7/5/3 long, mid and short convs
            "reduce_channel": [1, 1, 0],
            "return_channel": [1, 1, 0],
            **{
                f"{kind}_{ratio}": args
                for ratio, k in (("longratio", 7), ("midratio", 5), ("shortratio", 3))
                for kind, args in (
                    ("symmetric_conv_long", [k, 1, k // 2]),
                    ("vertical_long_to_small_conv", [[k, 1], 1, [k // 2, 0]]),
                    ("horizontal_small_to_long_conv", [[1, k], 1, [0, k // 2]]),
                )
            },
        }
    }
}
OVERRIDES: dict[str, dict] = {
    # widths are width_coefficient (2.0 by default: B7) x the stage channels, rounded to depth_divisor; divided
    # by 8 they no longer meet the depthwise group counts: a B0-like coefficient instead
    "efficientnet": {"config": {"width_coefficient": 0.25}},
    "align": {"config": {"width_coefficient": 0.25}},
    # modeling_cvt indexes a stage's drop-path rates by the stage number: stage i needs depth > i
    "cvt": {"config": {"depth": [1, 2, 3]}},
    # BatchNorm1d is behind options that are off by default: turned on, so that the BN path is swept
    "hubert": {"config": {"conv_pos_batch_norm": True}},
    "patchtsmixer": {"config": {"norm_mlp": "BatchNorm"}},
    # a timm model name is required; timm's own test_resnet is tiny and needs no weights
    "timm_backbone": {"config": {"backbone": "test_resnet", "use_pretrained_backbone": False}},
    # scale_factor_list is None by default as well: the neck upsamples its 4 levels to the finest one
    "pp_ocrv5_server_det": merge(_INTRACLASS, {"config": {"scale_factor_list": [1, 2, 4, 8]}}),
    "pp_ocrv6_medium_det": _INTRACLASS,
    "deformable_detr": _TIED_DECODER,
    "rt_detr_v2": _TIED_DECODER,
    "d_fine": _TIED_DECODER,
    "deimv2": _TIED_DECODER,
    # the default backbone is Swin (no BN): a ResNet backbone is what gets the family's frozen BN class
    "grounding_dino": merge(_TIED_DECODER, {"config": {"backbone_config": "small_resnet:2,3,4"}}),
    "mm_grounding_dino": merge(_TIED_DECODER, {"config": {"backbone_config": "small_resnet:2,3,4"}}),
    # BatchNorm2d in the fusion residual units is an option off by default
    "dpt": {"config": {"use_batch_norm_in_fusion_residual": True}},
    "zoedepth": {"config": {"use_batch_norm_in_fusion_residual": True}},
    # the BN is in the classic (deconv) decoder; the default is the simple one
    "vitpose": {"config": {"use_simple_decoder": False}},
    # the default config has no projector (where the BN is); the released checkpoints have one
    "lw_detr": {"config": {"projector_scale_factors": [1.0]}},
    # BeitForSemanticSegmentation needs 4 out_indices (the default config has none)
    "beit": {
        "config": {
            "out_indices": [1, 2, 3, 4],
            "out_features": ["stage1", "stage2", "stage3", "stage4"],
            "num_hidden_layers": 5,
        }
    },
    # the config refuses to build without prediction_length; the distilling conv layers (where the BN is)
    # sit between encoder layers: two layers make one
    "informer": {"config": {"prediction_length": 4, "encoder_layers": 2}},
    # two images per sample: (batch, 2, channels, H, W)
    "efficientloftr": {"input": (BATCH, 2, 3, IMAGE_SIDE, IMAGE_SIDE)},
    # image and trimap: 4 channels; the default config's backbone is 768 wide where the head expects
    # hidden_size 384 (the released configs agree): the backbone made 384 / 8 wide
    "vitmatte": {
        "config": {"backbone_config": {"num_channels": 4, "hidden_size": 48}},
        "width_factor": 8,
        "input": (BATCH, 4, IMAGE_SIDE, IMAGE_SIDE),
    },
    # patches of 384 pixels at ratios down to 1/4 need 1536-pixel images: 32-pixel patches of a 128-pixel
    # image instead, and two layers per ViT so that the hooked layers (11 and 5 of 24) exist
    "depth_pro": {
        "config": {
            "use_batch_norm_in_fusion_residual": True,
            "patch_size": 32,
            "intermediate_hook_ids": [1, 0],
            **{
                f"{part}_model_config": {"image_size": 32, "num_hidden_layers": 2} for part in ("image", "patch", "fov")
            },
        },
        "input": (BATCH, 3, 128, 128),
    },
    # random weights find keypoints everywhere (minutes per forward): at most 16 per image
    "superglue": {
        "config": {"keypoint_detector_config": {"max_keypoints": 16}},
        "input": (BATCH, 2, 3, IMAGE_SIDE, IMAGE_SIDE),
    },
    # the conv preprocessor's channels (322 = d_model + position encoding) must divide by the cross-attention heads
    # (its forward's first argument is named inputs: images of 224, which the conv preprocessor takes to 56)
    "perceiver": {"config": {"num_cross_attention_heads": 1}, "input": (BATCH, 3, 224, 224)},
    # the CTC encoder (where the BN is) takes the features as hidden_states: (batch, time, input_dim 160)
    "granite_speech": {"model": "GraniteSpeechCTCEncoder", "input": (BATCH, 64, 160)},
    "granite_speech_plus": {"model": "GraniteSpeechPlusCTCEncoder", "input": (BATCH, 64, 160)},
    # input_features is (batch, 1, time, mel bins); the Swin's patch width is not a width the generic rule
    # divides (its name says patch): 32 wide, with heads that divide each stage's width
    "clap": {
        "config": {"patch_embeds_hidden_size": 32, "num_attention_heads": [1, 2, 4, 8]},
        "input": (BATCH, 1, IMAGE_SIDE, IMAGE_SIDE),
    },
    # the encoder stacks frames: its input width is 4 x num_mel_bins
    "granite_speech5": {"input": (BATCH, 64, 320)},
    # the recognizer pools the 1/32 feature map by (3, 2): at least 96 pixels high
    "pp_ocrv5_mobile_rec": {"input": (BATCH, 3, 96, IMAGE_SIDE)},
    # hidden sizes / 8 (18, 24, 30) are not multiples of the 4 attention heads
    "mobilevit": {"config": {"hidden_sizes": [32, 48, 64]}},
}


# -- discovery (text only: importing every modeling module takes minutes) -----------------------


def transformers_root() -> Path:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("transformers is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0])


def discover(root: Path | None = None) -> list[dict]:
    """One entry per modeling module whose source names a BN class: family (the module name without
    ``modeling_``), its import path, and the BN names it mentions."""
    root = root or transformers_root()
    families = []
    for path in sorted((root / "models").glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        names = sorted(set(BN_PATTERN.findall(text)))
        if names:
            # lines that name a BN class other than in an isinstance check (weight init): where one is built
            builds = [line for line in text.splitlines() if BN_PATTERN.search(line) and "isinstance" not in line]
            families.append(
                {
                    "family": path.stem[len("modeling_") :],
                    "module": f"transformers.models.{path.parent.name}.{path.stem}",
                    "mentions": names,
                    "only_isinstance": not builds,
                }
            )
    return families


# -- small configs ---------------------------------------------------------------------------

#: int (or list of int) fields that are widths: divided by WIDTH_FACTOR
WIDTH_NAME = re.compile(
    r"hidden|_dim$|_dims$|^dim$|dim_|channels|d_model|d_latents|embed|ffn|intermediate|units|"
    r"feature_size|conv_dim|width|proj|feedforward|stem_|fusion_|neck_|aspp_|^out_features$"
)
NOT_WIDTH = re.compile(
    r"kernel|stride|patch|image|window|vocab|position|max_|_id$|_ids$|num_labels|pool|ratio|"
    r"length|_len$|dilation|padding|mel|groups|factor|scale|temperature|bins|seq|size_per|"
    r"out_indices|hook|coefficient|cost|_index$|sampl|queries|mask_|num_|input_dim"
)  # input_dim: the data's width
#: int fields that count layers or blocks: set to 1
DEPTH_NAME = re.compile(
    r"^(num_hidden_layers|num_layers|encoder_layers|decoder_layers|num_encoder_layers|"
    r"num_decoder_layers|num_attention_layers|speech_encoder_layers|t2u_encoder_layers|"
    r"t2u_decoder_layers|text_encoder_num_layers|decoder_num_layers|num_self_attends_per_block|"
    r"depth|query_dec_layers|num_adapter_layers)$"
)
#: list fields that count blocks per stage: each entry set to 1
DEPTH_LIST_NAME = re.compile(r"^(depths|depth|num_block_repeats|stage_num_blocks|n_attn_blocks|stage_numb_of_layers)$")
#: lists of layer numbers: with num_hidden_layers shrunk they are renumbered 1..k, order kept
INDEX_LIST_NAME = re.compile(r"^(out_indices|backbone_out_indices|intermediate_hook_ids)$")
#: token ids index the vocabulary: kept below the shrunk vocab size
TOKEN_NAME = re.compile(r"token_id$|token_index$|_token$|^decoder_start_token_id$")
VOCAB = 512


def _width(value: int, factor: int) -> int:
    """Every multiple of ``factor`` divided by it, the rest kept: one function of the value, so sizes that
    must be equal stay equal, and hidden = heads * head_dim still holds."""
    return value // factor if value % factor == 0 else value


def _renumber(values: list, layers: dict) -> list:
    return [layers[v] if v in layers else v for v in values]


def shrink(config: dict, factor: int = WIDTH_FACTORS[0], depths: bool = True) -> dict:
    """A config dict made small by one rule for every family: the same function of every width,
    so sizes that must be equal stay equal and ratios stay (where divisible); depths to 1; layer
    numbers (out_indices, "stageN" out_features of a transformer backbone) renumbered to the layers kept."""
    out = dict(config)
    layered = isinstance(out.get("num_hidden_layers"), int)
    for key, value in config.items():
        if isinstance(value, dict):
            out[key] = shrink(value, factor, depths)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if DEPTH_NAME.match(key):
                out[key] = min(value, 1)
            elif key == "num_queries" or key == "two_stage_num_proposals":
                out[key] = min(value, 10)
            elif key.endswith("vocab_size"):
                out[key] = min(value, VOCAB)
            elif TOKEN_NAME.search(key):
                out[key] = value if value < VOCAB else VOCAB - 1 - (value % 8)
            elif key == "image_size":
                patch = config.get("patch_size")
                out[key] = min(
                    value, IMAGE_SIDE if not isinstance(patch, int) or IMAGE_SIDE % patch == 0 else patch * 4
                )
            elif WIDTH_NAME.search(key) and not NOT_WIDTH.search(key):
                out[key] = _width(value, factor)
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            if DEPTH_LIST_NAME.match(key):
                out[key] = [min(v, 1) for v in value] if depths else value
            elif key == "image_size":
                out[key] = [min(v, IMAGE_SIDE) for v in value]
            elif WIDTH_NAME.search(key) and not NOT_WIDTH.search(key):
                out[key] = [_width(v, factor) for v in value]
    if layered:  # layer numbers that name the layers kept: 1..k in the same order, k layers
        stage = re.compile(r"^stage(\d+)$")
        numbers = set()
        for key, value in config.items():
            if INDEX_LIST_NAME.match(key) and isinstance(value, list):
                numbers |= {v for v in value if isinstance(v, int) and v > 0}
            if key == "out_features" and isinstance(value, list):
                numbers |= {int(m.group(1)) for v in value if isinstance(v, str) and (m := stage.match(v))}
        layers = {v: i + 1 for i, v in enumerate(sorted(numbers))}
        for key, value in config.items():
            if INDEX_LIST_NAME.match(key) and isinstance(value, list):
                out[key] = _renumber(value, layers)
            if key == "out_features" and isinstance(value, list):
                out[key] = [
                    f"stage{layers[int(m.group(1))]}"
                    if isinstance(v, str) and (m := stage.match(v)) and int(m.group(1)) in layers
                    else v
                    for v in value
                ]
        # one layer more than the highest number: 0-based (DPT) and 1-based (BEiT) readers both find theirs
        count = max(layers.values()) + 1 if layers else 1
        if "stage_names" in out and isinstance(out["stage_names"], list):
            out["stage_names"] = ["stem"] + [f"stage{i}" for i in range(1, count + 1)]
        out["num_hidden_layers"] = count
    backbone = out.get("backbone_config")
    if isinstance(backbone, dict) and backbone.get("model_type") == "timm_backbone":
        out["backbone_config"] = small_resnet(backbone.get("out_indices") or [1, 2, 3, 4])
        out["use_timm_backbone"] = False
        out["use_pretrained_backbone"] = False
    return out


def small_resnet(out_indices) -> dict:
    """transformers' own ResNet in place of a timm backbone (timm's would be resnet50): the small one
    tests/test_transformers.py builds DETR with."""
    from transformers import ResNetConfig

    stages = [f"stage{i}" for i in out_indices if 1 <= i <= 4] or ["stage4"]
    return ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], out_features=stages
    ).to_dict()


def fields_only(config) -> dict:
    """The config's own fields as a dict, sub-configs likewise: attributes that ``__post_init__`` derives
    (lw_detr's num_feature_levels from projector_scale_factors) would otherwise come back stale, set
    after the derivation."""
    from transformers import PreTrainedConfig

    names = {field.name for field in dataclasses.fields(type(config))}
    data = config.to_dict()
    kept = names | {"model_type", "out_features", "out_indices"}  # a backbone's outputs are init arguments too
    out = {key: value for key, value in data.items() if key in kept}
    for key in out:
        inner = getattr(config, key, None)
        if isinstance(inner, PreTrainedConfig):
            out[key] = fields_only(inner)
    return out


def small_config(config_class, overrides: dict | None = None, factor: int = WIDTH_FACTORS[0], depths: bool = True):
    config = shrink(fields_only(config_class()), factor, depths)
    config = merge(config, overrides or {})
    for key, value in list(config.items()):
        if isinstance(value, str) and value.startswith("small_resnet:"):  # an override naming a small ResNet
            config[key] = small_resnet([int(i) for i in value.split(":", 1)[1].split(",")])
    for key in ("architectures", "transformers_version", "_name_or_path"):
        config.pop(key, None)
    return config_class.from_dict(config)


# -- model classes and inputs -------------------------------------------------------------------

#: first forward arguments the checks can feed (float tensors; see check_input)
CHECKABLE = ("pixel_values", "input_values", "input_features", "past_values")


def first_argument(cls) -> str:
    import inspect

    params = [p for p in inspect.signature(cls.forward).parameters.values() if p.name != "self"]
    return params[0].name if params else ""


def candidates(module) -> list[str]:
    """Model classes the module exports that transformers exports too (a directory names its class
    by a top-level name): those whose forward takes a float input first, then by PREFERRED_SUFFIXES."""
    import transformers

    names = []
    for name in getattr(module, "__all__", []):
        cls = getattr(transformers, name, None)
        if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
            continue
        if name.endswith("PreTrainedModel") or name.endswith("PretrainedModel"):
            continue
        names.append(name)

    def rank(name: str) -> tuple[int, int, str]:
        checkable = first_argument(getattr(transformers, name)) in CHECKABLE
        suffix = next(
            (i for i, suffix in enumerate(PREFERRED_SUFFIXES) if name.endswith(suffix)), len(PREFERRED_SUFFIXES)
        )
        return (0 if checkable else 1), suffix, name

    return sorted(names, key=rank)


def _find(config, *names):
    """The first of ``names`` set on the config or one of its sub-configs (vision, backbone, encoder)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    for sub in ("vision_config", "encoder_config", "audio_config", "backbone_config"):
        inner = getattr(config, sub, None)
        if inner is not None and not isinstance(inner, dict):
            found = _find(inner, *names)
            if found is not None:
                return found
    return None


def check_input(model, config) -> "tuple[tuple[int, ...] | None, str]":
    """(input shape, why none) for the model's first forward argument: images, audio, features, series."""
    first = first_argument(type(model))
    if first == "pixel_values":
        channels = _find(config, "num_channels", "in_channels") or 3
        channels = channels if isinstance(channels, int) else 3
        side = _find(config, "image_size")
        side = side if isinstance(side, int) else (side[0] if isinstance(side, (list, tuple)) and side else IMAGE_SIDE)
        return (BATCH, channels, side, side), ""
    if first == "input_values":
        return (BATCH, 1600), ""
    if first == "input_features":
        features = _find(config, "num_mel_bins", "input_dim", "feature_size", "feature_projection_input_dim")
        return (BATCH, 64, int(features or 80)), ""
    if first == "past_values":
        return (BATCH, int(_find(config, "context_length") or 32), int(_find(config, "num_input_channels") or 1)), ""
    if first in ("input", "args", ""):
        return None, f"{type(model).__name__} has no forward of its own (it is used through other methods)"
    if "ids" in first:
        return None, (
            f"its forward takes integer {first} first: bnsurgeon's check inputs are float noise "
            "(--example-input refuses integer tensors)"
        )
    return None, f"its forward takes {first} first: the sweep has no input rule for it"


def runs_on(model, shape) -> str:
    """'' when the model's eval forward runs on seeded noise of ``shape``, else why not (one line)."""
    import torch

    try:
        with torch.no_grad():
            model.eval()(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    except Exception as error:
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    return ""


# -- one family (runs in the worker) ------------------------------------------------------------


def _step(status: str, reason: str = "") -> dict:
    return {"status": status, "reason": reason}


class SweepCheckFailed(Exception):
    """A comparison the sweep makes of bnsurgeon's result (keys, tensors, classes, outputs) failed."""


def _failure(error: BaseException) -> str:
    """One line: an error bnsurgeon raised on purpose says its exit code (as the CLI would exit), a
    comparison of the sweep's says so, anything else is a crash (the CLI's exit 70)."""
    from bnsurgeon.core.errors import BnSurgeonError

    if isinstance(error, BnSurgeonError):
        text = f"exit {error.exit_code}: {error.message}"
    elif isinstance(error, SweepCheckFailed):
        text = f"sweep check: {error}"
    else:
        text = f"internal error (exit 70): {type(error).__name__}: {error}"
    return " ".join(text.split())[:300]


def build(family: dict, override: dict) -> dict:
    """The first candidate class whose small build holds BN and runs on its check input, at the first of
    ATTEMPTS that works (else the smallest build that holds BN, with why it cannot be checked): model,
    class, config, input, BN counts; or why none."""
    import importlib

    import torch
    import transformers

    import bnsurgeon

    module = importlib.import_module(family["module"])
    names = [override["model"]] if override.get("model") else candidates(module)
    attempts = ATTEMPTS if not override.get("width_factor") else [(override["width_factor"], True)]
    tried, fallback = [], None
    for name in names:
        cls = getattr(transformers, name)
        failures, skip_depths = [], None
        for factor, depths in attempts:
            if depths == skip_depths:
                continue
            try:
                config = small_config(cls.config_class, override.get("config"), factor, depths)
                torch.manual_seed(0)
                model = cls(config).eval()
            except Exception as error:
                failures.append(f"{type(error).__name__}: {' '.join(str(error).split())[:160]}")
            else:
                inspection = bnsurgeon.inspect(model)
                if not inspection.groups:
                    failures.append("no BN-family module")
                    break  # sizes do not add modules
                frozen = sum(g.count for g in inspection.groups if "Frozen" in g.cls.rsplit(".", 1)[-1])
                built = {
                    "model": model,
                    "cls": name,
                    "config": config,
                    "bn": inspection.bn_modules,
                    "frozen": frozen,
                    "classes": {g.cls.rsplit(".", 1)[-1]: g.count for g in inspection.groups},
                    "unhandled": inspection.unhandled,
                    "tried": tried,
                    "width_factor": factor,
                    "paths": [path for group in inspection.groups for path in group.all_paths],
                    "depths_shrunk": depths,
                }
                shape, why = (tuple(override["input"]), "") if override.get("input") else check_input(model, config)
                if shape is not None:
                    why = runs_on(model, shape)
                    why = f"the model does not run on {shape}: {why}" if why else ""
                built.update(shape=shape if not why else None, why_no_input=why)
                if not why:
                    return built
                fallback = fallback or built  # the smallest build that holds BN
                failures.append(why)
                if shape is None:  # no input rule: the same at every size
                    break
            if len(failures) >= 2 and failures[-1] == failures[-2] and not re.search(r"\d", failures[-1]):
                # the same failure at another width, naming no size (a missing argument, an attribute):
                # not a size problem, at these depths at least
                skip_depths = depths
        tried.append(f"{name}: {failures[-1] if failures else 'not built'}")
        if (
            fallback is not None
            and fallback["cls"] == name
            and len(failures) > 1
            and failures[-1] != fallback["why_no_input"]
        ):
            factor, depths = attempts[min(len(failures), len(attempts)) - 1]
            fallback["why_no_input"] += (
                f" (and at every size tried; at width / {factor} with "
                f"{'depths to 1' if depths else 'the default depths'}: {failures[-1][:200]})"
            )
    if fallback is not None:
        return fallback
    return {"tried": tried or ["the module exports no model class transformers exports"]}


def compare_at_candidates(paths: list[str], model, tries: int = 3) -> list[str]:
    """Submodules to compare at, largest first: the deepest one that holds every BN module, then down the
    child that holds the most of them."""
    from torch import nn

    modules = {
        path: module for path, module in model.named_modules() if not isinstance(module, (nn.ModuleList, nn.ModuleDict))
    }  # containers are never called
    split = [path.split(".") for path in paths]
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    current = ".".join(common[:-1] if len(common) == min(len(p) for p in split) else common)
    while current and current not in modules:
        current = current.rpartition(".")[0]
    found = [current] if current else []
    while len(found) < tries:
        prefix = current + "." if current else ""
        counts: dict[str, int] = {}
        for path in paths:
            if path.startswith(prefix) and path != current:
                child = prefix + path[len(prefix) :].split(".", 1)[0]
                if child != path:  # a container, not the BN module itself
                    counts[child] = counts.get(child, 0) + 1
        if not counts:
            break
        current = max(counts, key=lambda child: (counts[child], -len(child)))
        if current in modules:
            found.append(current)
    return found


def sweep_family(family: dict, steps: tuple[str, ...], world_size: int, workdir: str) -> dict:
    import torch

    import bnsurgeon
    from bnsurgeon import api
    from bnsurgeon.checks.outputs import flatten_tensors

    started = time.perf_counter()
    name = family["family"]
    row = {
        "family": name,
        "module": family["module"],
        "mentions": family["mentions"],
        "steps": {step: _step("n.a.", "not run") for step in STEPS},
    }
    override = OVERRIDES.get(name, {})
    if override.get("skip"):
        row.update(status="skipped", reason=override["skip"])
        return row
    begun = time.perf_counter()
    try:
        built = build(family, override)
    except Exception as error:  # the module itself does not import (a missing package)
        row.update(
            status="skipped",
            reason=f"cannot import {family['module']}: {type(error).__name__}: {' '.join(str(error).split())[:200]}",
        )
        return row
    if "model" not in built:
        by_why: dict[str, list[str]] = {}
        for line in built["tried"]:
            cls_name, _, why = line.partition(": ")
            by_why.setdefault(why, []).append(cls_name)
        tried = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_why.items())
        if family.get("only_isinstance"):
            reason = (
                f"builds no BN-family module: the source names {', '.join(family['mentions'])} only in "
                f"isinstance checks (weight init) ({tried})"
            )
        elif all(why == "no BN-family module" for why in by_why):
            reason = f"no BN-family module with the default options ({tried})"
        else:
            reason = f"no model class builds small ({tried})"
        row.update(status="skipped", tried=built["tried"], reason=" ".join(reason.split())[:500])
        return row
    model = built["model"]
    row.update(
        cls=built["cls"],
        bn=built["bn"],
        frozen=built["frozen"],
        classes=built["classes"],
        unhandled=built["unhandled"],
        tried=built["tried"],
        width_factor=built["width_factor"],
        depths_shrunk=built["depths_shrunk"],
        parameters=sum(p.numel() for p in model.parameters()),
    )
    shape, why_no_input = built["shape"], built["why_no_input"]
    row["input_shape"] = list(shape) if shape else None
    source = Path(workdir) / name
    model.save_pretrained(source)
    try:  # what bnsurgeon does with the directory: a directory transformers cannot load is no SOURCE at all
        import transformers

        getattr(transformers, built["cls"]).from_pretrained(str(source), local_files_only=True)
    except Exception as error:
        row.update(
            status="skipped",
            reason=f"transformers cannot load the {built['cls']} directory it saved: "
            f"{type(error).__name__}: {' '.join(str(error).split())[:200]}",
        )
        return row
    reference_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    source_classes = {path: type(module).__name__ for path, module in model.named_modules() if path in built["paths"]}
    out = Path(workdir) / f"{name}.sync.safetensors"
    back = Path(workdir) / f"{name}.back.safetensors"
    frozen = built["frozen"] > 0
    s = row["steps"]
    check = {"input_shape": shape} if shape else {}

    seconds = row["step_seconds"] = {"build": round(time.perf_counter() - begun, 1)}

    def run(step: str, fn) -> bool:
        if step not in steps:
            s[step] = _step("n.a.", "not asked for (--steps)")
            return True
        begun = time.perf_counter()
        try:
            fn()
            if s[step]["status"] == "n.a." and s[step]["reason"] == "not run":
                s[step] = _step("pass")
        except Exception as error:
            s[step] = _step("FAIL", _failure(error))
        seconds[step] = round(time.perf_counter() - begun, 1)
        return s[step]["status"] != "FAIL"

    def inspect_step():
        result = api.inspect(str(source))
        if result.bn_modules != built["bn"] or result.unhandled:
            raise SweepCheckFailed(
                f"inspect of the directory: {result.bn_modules} BN modules, {result.unhandled} "
                f"unhandled; the built model has {built['bn']}"
            )
        s["inspect"] = _step("pass", ", ".join(f"{k} x{v}" for k, v in built["classes"].items()))

    def convert_step():
        outcome = api.convert_source(
            str(source), out, to="sync", frozen="unfreeze" if frozen else "keep", check=shape is not None, **check
        )
        report = outcome.result.report
        note = f"{len(report.changed)} converted"
        if report.check is not None:
            note += f", eval check on {report.check.input} max |diff| {report.check.max_abs_diff:.3g}"
        else:
            note += f" (no eval check: {why_no_input})"
        s["convert"] = _step("pass", note)

    run("inspect", inspect_step)
    converted = run("convert", convert_step) and "convert" in steps

    def verify(compare_at: str | None = None) -> tuple[dict, str]:
        """verify's checks by step (each told as it finishes: what ran before a raise still counts), and
        the one-line reason when it raised."""
        groups: dict[str, list] = {"eval": [], "train": [], "ranks": []}

        def told(outcome) -> None:
            key = "eval" if outcome.name.startswith("eval") else "ranks" if "ranks" in outcome.name else "train"
            groups[key].append(outcome)

        begun = time.perf_counter()
        try:
            api.verify(
                str(source),
                str(out),
                world_sizes=(world_size,) if "ranks" in steps else (),
                on_check=told,
                compare_at=compare_at,
                **check,
            )
            raised = ""
        except Exception as error:
            raised = "verify raised: " + _failure(error)
        seconds["verify"] = round(seconds.get("verify", 0) + time.perf_counter() - begun, 1)
        return groups, raised

    def judge(key: str, outcomes: list, raised: str, where: str = "") -> dict:
        failed = next((o for o in outcomes if o.passed is False), None)
        if failed is not None:
            return _step(
                "FAIL",
                " ".join(f"{where}{failed.name}: max |diff| {failed.max_abs_diff:.3g} {failed.detail}".split())[:300],
            )
        if raised:
            return (
                _step("FAIL", raised)
                if not outcomes or key == "ranks"
                else _step("pass", f"{len(outcomes)} checks passed before verify raised")
            )
        if outcomes and all(o.passed is None for o in outcomes):
            return _step("n.a.", outcomes[0].detail[:200])
        if outcomes:
            return _step("pass", where + "; ".join(f"{o.name}: max |diff| {o.max_abs_diff:.3g}" for o in outcomes))
        return _step("n.a.", "verify ran no such check")

    if converted and shape is not None:
        if any(step in steps for step in ("eval", "train", "ranks")):
            groups, raised = verify()
            for key, outcomes in groups.items():
                s[key] = judge(key, outcomes, raised) if key in steps else _step("n.a.", "not asked for (--steps)")
            # outputs that are not per sample (a layer-first stack, image pairs flattened) cannot be lined up
            # by rank: compared, as verify's message says, at the submodule that holds the BN modules
            for compare_at in compare_at_candidates(built["paths"], model):
                if "not per sample" not in s["ranks"]["reason"]:
                    break
                inside = sum(1 for path in built["paths"] if path.startswith(compare_at + "."))
                groups, raised = verify(compare_at)
                s["ranks"] = judge(
                    "ranks",
                    groups["ranks"],
                    raised,
                    f"at --compare-at {compare_at} ({inside} of {built['bn']} BN modules inside): ",
                )
    elif not converted:
        for key in ("eval", "train", "ranks", "revert", "load"):
            s[key] = _step("n.a.", "convert failed" if "convert" in steps else "needs convert")
    else:
        for key in ("eval", "train", "ranks"):
            s[key] = _step("n.a.", why_no_input)

    def revert_step():
        target = "frozen" if frozen else "plain"
        frozen_paths = tuple(glob.escape(path) for path in built["paths"] if "Frozen" in source_classes.get(path, ""))
        if frozen and len(frozen_paths) < len(built["paths"]):
            # frozen and plain BN in one model: --to frozen would freeze the plain ones too, --to plain thaw the
            # frozen ones; each goes back to its own class in its own pass
            middle = Path(workdir) / f"{name}.middle.safetensors"
            api.convert_source(str(out), middle, to="plain", exclude=frozen_paths, check=shape is not None, **check)
            api.convert_source(str(middle), back, to="frozen", include=frozen_paths, check=shape is not None, **check)
            target = f"plain --exclude FROZEN, then --to frozen --include FROZEN ({len(frozen_paths)} paths)"
        else:
            api.convert_source(str(out), back, to=target, check=shape is not None, **check)
        reverted = bnsurgeon.load(back)  # a file stores a tied tensor once: compare the rebuilt model
        state = reverted.state_dict()
        missing, extra = sorted(set(reference_state) - set(state)), sorted(set(state) - set(reference_state))
        if missing or extra:
            raise SweepCheckFailed(
                f"--to {target}: the rebuilt model's state-dict keys differ from the source's: "
                f"missing {missing[:3]}, extra {extra[:3]}"
            )
        differ = [k for k, v in reference_state.items() if not torch.equal(state[k], v)]
        if differ:
            raise SweepCheckFailed(f"--to {target}: {len(differ)} tensors differ from the source's, e.g. {differ[0]}")
        theirs = {path: type(module).__name__ for path, module in reverted.named_modules()}
        changed = [
            f"{path}: {cls} -> {theirs.get(path)}" for path, cls in source_classes.items() if theirs.get(path) != cls
        ]
        if changed:
            raise SweepCheckFailed(
                f"--to {target}: {len(changed)} BN modules are not of their source class, e.g. {changed[0]}"
            )
        s["revert"] = _step("pass", f"--to {target}: the source's classes and tensors, key for key")

    def load_step():
        loaded = bnsurgeon.load(out)
        if type(loaded).__name__ != built["cls"]:
            raise SweepCheckFailed(f"load gave {type(loaded).__name__}, not {built['cls']}")
        if shape is None:
            s["load"] = _step("pass", "loaded (outputs not compared: no check input)")
            return
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = flatten_tensors(model.eval()(x.clone()))
            actual = flatten_tensors(loaded.eval()(x.clone()))
        if len(expected) != len(actual):
            raise SweepCheckFailed(f"load: {len(actual)} output tensors, the source gives {len(expected)}")
        exact = not frozen
        for a, b in zip(expected, actual):
            same = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-5)
            if not same:
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")
                raise SweepCheckFailed(f"load: eval outputs differ from the source's (max |diff| {diff:.3g})")
        s["load"] = _step(
            "pass", "eval outputs " + ("bit-identical" if exact else "within rtol 1e-4") + " to the source's"
        )

    if converted:
        run("revert", revert_step)
        run("load", load_step)
    failed = [k for k, v in s.items() if v["status"] == "FAIL"]
    row["status"] = "FAIL" if failed else "pass"
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


# -- the worker and the sweep -----------------------------------------------------------------------


def _worker(tasks, results, steps, world_size, threads):
    os.setsid()  # its own process group: a timeout kills it with its rank processes
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    importlib.import_module("bnsurgeon.api")  # imported before the first family's clock starts

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar: the sweep prints one line per family
    warnings.filterwarnings("ignore")  # init warnings of tiny layers; failures are recorded, not warned
    results.put({"ready": True})
    with tempfile.TemporaryDirectory(prefix="hf_sweep_") as workdir:
        while True:
            family = tasks.get()
            if family is None:
                return
            folder = Path(workdir) / family["family"]
            folder.mkdir()
            try:
                row = sweep_family(family, steps, world_size, str(folder))
            except BaseException as error:  # the sweep's own failure, not bnsurgeon's: say so
                import traceback

                row = {
                    "family": family["family"],
                    "module": family["module"],
                    "status": "error",
                    "reason": f"sweep error: {type(error).__name__}: {' '.join(str(error).split())[:200]}",
                    "traceback": traceback.format_exc()[-2000:],
                }
            results.put(row)


def _start(context, steps, world_size, threads):
    tasks, results = context.Queue(), context.Queue()
    worker = context.Process(target=_worker, args=(tasks, results, steps, world_size, threads), daemon=False)
    worker.start()
    try:
        results.get(timeout=300)  # its imports done: the time box counts the family's own work
    except queue.Empty:
        _kill(worker)
        raise SystemExit("the sweep's worker did not start within 300 s") from None
    return worker, tasks, results


def _kill(worker) -> None:
    try:
        os.killpg(worker.pid, signal.SIGKILL)  # the worker and the rank processes it started
    except (ProcessLookupError, PermissionError):
        worker.kill()
    worker.join(timeout=10)


def run_sweep(
    families: list[dict], steps: tuple[str, ...], world_size: int, timeout: float, threads: int
) -> list[dict]:
    context = mp.get_context("spawn")
    worker, tasks, results = _start(context, steps, world_size, threads)
    rows = []
    try:
        for index, family in enumerate(families):
            tasks.put(family)
            started = time.monotonic()
            row = None
            while row is None:
                try:
                    row = results.get(timeout=2)
                except queue.Empty:
                    if not worker.is_alive():
                        row = {
                            "family": family["family"],
                            "module": family["module"],
                            "status": "error",
                            "reason": f"the worker died (exit code {worker.exitcode})",
                        }
                    elif time.monotonic() - started > timeout:
                        row = {
                            "family": family["family"],
                            "module": family["module"],
                            "status": "timeout",
                            "reason": f"over {timeout:.0f}s (--timeout-per-family)",
                        }
                    if row is not None:
                        _kill(worker)
                        worker, tasks, results = _start(context, steps, world_size, threads)
            rows.append(row)
            print(
                f"[{index + 1}/{len(families)}] {family['family']}: {row['status']} "
                f"({time.monotonic() - started:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        tasks.put(None)
        worker.join(timeout=30)
        if worker.is_alive():
            _kill(worker)
    return rows


# -- report ---------------------------------------------------------------------------------------


def known(reason: str) -> str | None:
    return next((label for pattern, label in KNOWN_FAILURES if re.search(pattern, reason)), None)


def cell(step: dict) -> str:
    status = step["status"]
    if status == "FAIL":
        return "known" if known(step["reason"]) else "FAIL"
    return status


def table(rows: list[dict]) -> str:
    header = ["family", "class", "BN", "frozen", *STEPS, "s"]
    lines = [header]
    for r in rows:
        if r["status"] in ("pass", "FAIL"):
            lines.append(
                [
                    r["family"],
                    r.get("cls", ""),
                    str(r.get("bn", "")),
                    str(r.get("frozen", "")),
                    *(cell(r["steps"][step]) for step in STEPS),
                    str(r.get("seconds", "")),
                ]
            )
        else:
            lines.append(
                [
                    r["family"],
                    r.get("cls", "-"),
                    str(r.get("bn", "-")),
                    str(r.get("frozen", "-")),
                    r["status"],
                    *([""] * (len(STEPS) - 1)),
                    "",
                ]
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(value.ljust(width) for value, width in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(text)


def details(rows: list[dict]) -> str:
    """One line per failed step and per n.a. reason (steps with the same one together), and per family
    not swept."""
    out = []
    for r in rows:
        if r["status"] in ("pass", "FAIL"):
            lines: dict[tuple[str, str], list[str]] = {}
            for step in STEPS:
                value = r["steps"][step]
                if value["status"] == "FAIL" or (value["status"] == "n.a." and value["reason"] != "not run"):
                    lines.setdefault((value["status"], value["reason"]), []).append(step)
            for (status, reason), names in lines.items():
                label = known(reason) if status == "FAIL" else None
                out.append(
                    f"  {r['family']}: {'/'.join(names)} {status}{' (known: ' + label + ')' if label else ''}: {reason}"
                )
        else:
            out.append(f"  {r['family']}: {r['status']}: {r.get('reason', '')}")
    return "\n".join(out)


def totals(rows: list[dict]) -> dict:
    swept = [r for r in rows if r["status"] in ("pass", "FAIL")]
    failed = [r for r in swept if r["status"] == "FAIL"]
    unexpected = [
        r for r in failed if any(v["status"] == "FAIL" and not known(v["reason"]) for v in r["steps"].values())
    ]
    skipped = [r for r in rows if r["status"] == "skipped"]
    reasons: dict[str, int] = {}
    for r in skipped:
        key = (
            "BN only in isinstance checks"
            if r["reason"].startswith("builds no BN-family")
            else "no BN with the default options"
            if r["reason"].startswith("no BN-family")
            else "cannot be built small"
            if r["reason"].startswith("no model class builds")
            else "cannot import"
            if r["reason"].startswith("cannot import")
            else "transformers cannot load its own directory"
            if r["reason"].startswith("transformers cannot load")
            else r["reason"][:60]
        )
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "families": len(rows),
        "all_pass": sum(1 for r in swept if r["status"] == "pass"),
        "fail": len(failed),
        "fail_known_only": len(failed) - len(unexpected),
        "fail_unexpected": len(unexpected),
        "skipped": len(skipped),
        "skipped_reasons": reasons,
        "timeout": sum(1 for r in rows if r["status"] == "timeout"),
        "error": sum(1 for r in rows if r["status"] == "error"),
        "no_check_input": sum(1 for r in swept if r["steps"]["eval"]["status"] == "n.a."),
    }


def totals_line(t: dict) -> str:
    skipped = ", ".join(f"{n} {why}" for why, n in t["skipped_reasons"].items())
    return (
        f"{t['families']} families: {t['all_pass']} all pass, {t['fail']} fail ({t['fail_known_only']} known only, "
        f"{t['fail_unexpected']} unexpected), {t['skipped']} skipped ({skipped or 'none'}), {t['timeout']} timeout, "
        f"{t['error']} sweep error; {t['no_check_input']} swept without a check input"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated family names (default: every one found)")
    parser.add_argument("--list", action="store_true", help="print the families found and exit")
    parser.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated steps to run (default: all of {','.join(STEPS)})"
    )
    parser.add_argument("-w", "--world-size", type=int, default=2, help="ranks of verify's N-rank check")
    parser.add_argument("--timeout-per-family", type=float, default=300.0, help="seconds, then the family is killed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the worker")
    parser.add_argument("--json", metavar="PATH", help="write every row and the totals as JSON")
    args = parser.parse_args()

    found = discover()
    if args.list:
        for family in found:
            print(f"{family['family']:28} {family['module']:60} {', '.join(family['mentions'])}")
        print(f"{len(found)} families")
        return 0
    families = found
    if args.families:
        wanted = [name.strip() for name in args.families.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {f["family"] for f in found})
        if unknown:
            parser.error(f"no such family among the {len(found)} found: {', '.join(unknown)} (see --list)")
        families = [f for f in found if f["family"] in wanted]
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    bad = sorted(set(steps) - set(STEPS))
    if bad:
        parser.error(f"unknown steps {', '.join(bad)}: choose from {', '.join(STEPS)}")
    started = time.monotonic()
    rows = run_sweep(families, steps, args.world_size, args.timeout_per_family, args.threads)
    elapsed = time.monotonic() - started
    t = totals(rows)
    print(table(rows))
    print()
    print("details:")
    print(details(rows))
    print()
    print(totals_line(t) + f" ({elapsed / 60:.1f} min)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"totals": t, "seconds": round(elapsed, 1), "families": rows}, indent=1, default=str) + "\n"
        )
    return 1 if t["fail_unexpected"] or t["timeout"] or t["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
