"""SOURCE kind: a Hugging Face transformers model directory (what ``save_pretrained`` writes:
``config.json`` plus ``model.safetensors``, shards with an index, or ``pytorch_model.bin``).

The config is data and transformers' own classes are library code, as a timm name is: the class
named by the config's ``architectures`` is taken from the ``transformers`` package itself (never
imported by a name from the file) and built with ``from_pretrained(local_files_only=True)``. A
config that asks for remote code (``auto_map``) names code from the file: refused, because
bnsurgeon runs code only when the user names it (a factory that calls ``from_pretrained(...,
trust_remote_code=True)`` is how to name it). What rebuilds the model (class + config) is
recorded in bnsurgeon's output, so ``bnsurgeon.load(out)`` needs no arguments.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from bnsurgeon.core.errors import (
    CheckpointError,
    ConfirmationError,
    PreprocessorConfigError,
    SourceNotFoundError,
    UnsafeCheckpointError,
    UsageError,
    WeightsMismatchError,
    first_line,
)
from bnsurgeon.core.json_text import (
    NonFiniteConstantError,
    RepeatedKeyError,
    nesting_depth,
    refuse_constant,
    unique_keys,
)
from bnsurgeon.core.layout import shown
from bnsurgeon.files.reading import read_checkpoint

if TYPE_CHECKING:
    import torch
    from torch import nn

CONFIG_NAME = "config.json"
#: the weights files save_pretrained writes; one of them beside config.json makes the directory the SOURCE
WEIGHTS_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: the shards of a sharded save_pretrained
SHARD_PATTERN = re.compile(r"^(model-\d+-of-\d+\.safetensors|pytorch_model-\d+-of-\d+\.bin)$")
#: a transformers model class name (DetrForObjectDetection): an identifier, nothing to import
CLASS_PATTERN = re.compile(r"^[A-Z][A-Za-z0-9_]{0,99}$")
#: transformers builds id2label with one entry per label before any weight is read: 3 million is 3 GB
MAX_LABELS = 100_000
#: a config.json is a few KB; a bigger one is not a config
MAX_CONFIG_BYTES = 1 << 20


def read_config(directory: Path) -> dict[str, Any]:
    """config.json as data: a JSON object, bounded, naming a transformers class, asking for no remote code."""
    path = directory / CONFIG_NAME
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(
            f"{path} is {path.stat().st_size:,} bytes, not a model config", "pass the model directory"
        )
    try:
        config = json.loads(
            path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys, parse_constant=refuse_constant
        )
    except NonFiniteConstantError as error:
        raise CheckpointError(
            f"{path} holds {error.constant}, which is not a JSON value (bnsurgeon writes only strict JSON)",
            "write the number as a finite value, or save the model again with save_pretrained",
        ) from None
    except RepeatedKeyError as error:
        raise CheckpointError(
            f"{path} repeats the key {shown(error.key, 100)}: JSON readers disagree on which "
            "value counts, so bnsurgeon reads neither",
            "keep one entry for the key (save the model again with save_pretrained)",
        ) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({first_line(error)})", "the file is truncated or corrupt; save the model again"
        ) from None
    except RecursionError:
        raise CheckpointError(
            f"{path} is nested too deeply to be a model config", "the file is corrupt or hostile; save the model again"
        ) from None
    check_config(config, str(path))
    return config


def check_config(config: Any, origin: str) -> None:
    if not isinstance(config, dict):
        raise CheckpointError(f"{origin} is not a JSON object", "pass a directory save_pretrained wrote")
    if "auto_map" in config:
        raise ConfirmationError(
            f"{origin} asks for remote code (auto_map {shown(config['auto_map'], 80)}): importing it runs code from "
            "the model directory, so bnsurgeon does not",
            "if you trust that code, write a factory that calls from_pretrained(..., trust_remote_code=True) "
            "and pass it as SOURCE (package.module:function)",
        )
    classes = config.get("architectures")
    if not isinstance(classes, list) or not classes or not all(isinstance(name, str) for name in classes):
        raise CheckpointError(
            f"{origin} names no model class (its 'architectures' list is missing or empty)",
            "save the model with save_pretrained (it records its class), or pass a factory",
        )
    if not CLASS_PATTERN.match(classes[0]):
        raise CheckpointError(
            f"{origin} names the class {shown(classes[0], 80)}, not a transformers model class",
            "pass a factory that builds the model",
        )
    for where, part in config_parts(config):  # a backbone_config, text_config, ... builds its own labels too
        labels = part.get("num_labels", 0)
        if (
            isinstance(labels, bool)
            or not isinstance(labels, int)
            or not 0 <= labels <= MAX_LABELS
            or any(
                len(part.get(key) or ()) > MAX_LABELS
                for key in ("id2label", "label2id")
                if isinstance(part.get(key), (dict, list))
            )
        ):
            raise CheckpointError(
                f"{origin} asks for {shown(labels, 40)} labels{where} (at most {MAX_LABELS:,}): "
                "the config builds a Python object per label before any weight is read",
                "save the model again with save_pretrained, or restore its config.json",
            )
    layers = layer_count(config)
    if layers > MAX_LAYERS:
        raise CheckpointError(
            f"{origin} asks for {layers:,} layers in all (at most {MAX_LAYERS:,}): the config "
            "builds every one before any weight is read",
            "save the model again with save_pretrained, or restore its config.json",
        )


#: no model's config asks for more layers (depths, num_hidden_layers, ... summed over every sub-config): the
#: deepest have a few hundred, and each is built (Python objects, meta tensors) before any weight is read
MAX_LAYERS = 2_000
#: config keys that count layers or blocks (``depths``, ``num_hidden_layers``, ``encoder_layers``, ...)
LAYER_KEY = re.compile(r"(depth|layers|blocks|repeats)", re.IGNORECASE)


def config_parts(config: dict[str, Any], where: str = "", depth: int = 0) -> "list[tuple[str, dict[str, Any]]]":
    """The config and every config nested in it (``backbone_config``, ...), each with where it is (`` in x.y``)."""
    parts = [(where, config)]
    if depth < 8:
        for key, value in config.items():
            if isinstance(value, dict) and key not in ("id2label", "label2id"):  # labels are no config
                parts += config_parts(value, f"{where or ' in '}{'.' if where else ''}{key}", depth + 1)
    return parts


def layer_count(config: dict[str, Any]) -> int:
    """The layers a config asks for: every whole number under a layer-counting key, in it and its sub-configs."""

    def total(value: Any, depth: int = 0) -> int:
        if isinstance(value, bool):
            return 0
        if isinstance(value, int):
            return max(value, 0)
        if isinstance(value, (list, tuple)) and depth < 4:
            return sum(total(item, depth + 1) for item in value)
        return 0

    return sum(
        total(value)
        for _, part in config_parts(config)
        for key, value in part.items()
        if isinstance(key, str) and LAYER_KEY.search(key)
    )


def model_class(name: str) -> Any:
    """The transformers model class called ``name`` (from the package itself)."""
    try:
        import transformers
    except ImportError:
        raise SourceNotFoundError(
            "a Hugging Face model directory needs transformers", "pip install transformers"
        ) from None
    cls = getattr(transformers, name, None) if CLASS_PATTERN.match(name) else None
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise SourceNotFoundError(
            f"transformers {transformers.__version__} has no model class {shown(name, 80)}",
            "upgrade transformers, or pass a factory that builds the model",
        )
    return cls


@contextmanager
def hub_offline() -> Iterator[None]:
    """No request to the model hub while a model is built or loaded, whatever its config names (a backbone repo,
    pretrained backbone weights): huggingface_hub refuses every request in offline mode, read at each call."""
    import huggingface_hub.constants as hub

    saved, saved_env = hub.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    hub.HF_HUB_OFFLINE, os.environ["HF_HUB_OFFLINE"] = True, "1"
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = saved
        if saved_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved_env


def local_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every ``use_pretrained_backbone`` false (at any depth): the weights come from the directory
    or the file, so a pretrained backbone would only be downloaded to be overwritten."""
    copy = {}
    for key, value in config.items():
        if key == "use_pretrained_backbone":
            value = False
        elif isinstance(value, dict):
            value = local_config(value)
        copy[key] = value
    return copy


def build(name: str, kwargs: dict[str, Any], origin: str | None = None) -> "nn.Module":
    """``name`` built from ``config`` (seeded or meta per the caller's device context): the one recorded in a
    bnsurgeon file, or ``origin``, a directory's config.json. Local only (``hub_offline``, ``local_config``)."""
    cls = model_class(name)
    config = kwargs.get("config")
    check_config(config, origin or f"the recorded config of {name}")
    assert isinstance(config, dict)  # check_config refused anything else
    try:
        with hub_offline():
            return cls(cls.config_class.from_dict(local_config(config))).eval()
    except Exception as error:
        text = " ".join(str(error).split())[:300] or type(error).__name__
        if origin is not None:
            raise CheckpointError(
                f"transformers {name} cannot be built from {origin}: {type(error).__name__}: {text}",
                "save the model again with save_pretrained, or restore its config.json",
            ) from None
        raise UsageError(
            f"transformers {name} cannot be built from its recorded config: {type(error).__name__}: {text}",
            "convert the original model directory again",
        ) from None


def load_directory(directory: Path, meta: bool = False) -> "tuple[nn.Module, str, dict[str, Any]]":
    """(model with the directory's weights, class name, config) via transformers, local files only."""
    config = read_config(directory)
    name = config["architectures"][0]
    cls = model_class(name)
    import torch

    check_shard_index(directory)
    tensors = stored_tensors(directory)
    check_layer_count(directory, config, tensors)
    with torch.device("meta"):
        skeleton = build(name, {"config": config}, origin=str(directory / CONFIG_NAME))
    check_model_size(directory, name, skeleton)
    stored = stored_dtype(tensors)
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # bnsurgeon's output is its own lines; the caller's settings come back
    hf_logging.set_verbosity_error()  # its load report: check_loading_info says what matters, in one line
    try:
        # the weights as stored (check_as_stored proves it): dtype "auto" follows config.json, which would round them;
        # shapes that do not fit are reported by check_loading_info, naming the key
        # meta: nothing allocated, but transformers' own key mapping and loading info, so that the weights must
        # fit as for a real load (inspect as convert)
        with hub_offline():
            model, info = cls.from_pretrained(
                str(directory),
                local_files_only=True,
                output_loading_info=True,
                dtype=stored or "auto",
                ignore_mismatched_sizes=True,
                config=cls.config_class.from_dict(local_config(config)),
                **({"device_map": "meta"} if meta else {}),
            )
    except Exception as error:
        pickled = any(path.suffix == ".bin" for path in weights_files(directory))
        if pickled and (isinstance(error, pickle.UnpicklingError) or "weights_only" in str(error)):
            raise UnsafeCheckpointError(
                f"{directory}: its weights file is a pickle that would run code when loaded "
                f"(torch refused it with weights_only=True)",
                "ask for the model saved with save_pretrained (model.safetensors); bnsurgeon never runs code "
                "from a model directory",
            ) from None
        raise CheckpointError(
            f"{directory}: transformers could not load {name}: {type(error).__name__}: {first_line(error)}",
            "check the directory's weights files",
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    check_loading_info(directory, name, info)
    if meta:
        return model.eval(), name, config
    check_as_stored(directory, model, tensors)
    own_memory(model)
    return model.eval(), name, model.config.to_dict()


def own_memory(model: "nn.Module") -> None:
    """Give every tensor its own memory, as ``bnsurgeon.load`` does: from_pretrained may leave views of the
    weights file, at addresses a kernel treats differently from aligned ones (single-threaded conv gave another
    last bit than the same weights loaded by bnsurgeon), and a file rewritten later would change the model."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():  # tied parameters are one object: they stay tied
            parameter.data = parameter.data.clone()
        copies: dict[int, "torch.Tensor"] = {}
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = copies.setdefault(id(buffer), buffer.clone())


def weights_files(directory: Path) -> list[Path]:
    """The files save_pretrained writes for the weights (single, shards, their indexes), sorted."""
    return sorted(
        path
        for path in directory.iterdir()
        if path.is_file() and (path.name in WEIGHTS_NAMES or SHARD_PATTERN.match(path.name))
    )


def directory_inputs(directory: Path) -> list[Path]:
    """Every file a model directory SOURCE may read: config.json, the weights files, and each file a shard index
    names (none of them may be an output, ``--force`` or not)."""
    files = [directory / CONFIG_NAME, *weights_files(directory)]
    for index in (path for path in list(files) if path.name.endswith(".index.json")):
        files += [directory / name for name in index_file_names(index) if Path(name).name == name]
    return list(dict.fromkeys(files))


def index_file_names(index: Path) -> list[str]:
    """The file names a shard index maps tensors to ([] where it is no readable index: check_shard_index says so)."""
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            return []
        files = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, UnicodeDecodeError, RecursionError, AttributeError):
        return []
    return sorted({name for name in files.values() if isinstance(name, str)}) if isinstance(files, dict) else []


#: the fewest bytes an element can take in a weights file (4-bit quantized); more elements than this allows is
#: a config that describes another model than the weights
MIN_BYTES_PER_ELEMENT = 0.5
SLACK_BYTES = 1 << 20


def check_model_size(directory: Path, name: str, skeleton: "nn.Module") -> None:
    """The config shapes the model before any weight is read: one whose tensors could not fit in the directory's
    weights files (hidden sizes edited up by 1000x) is refused before from_pretrained allocates it."""
    tensors = {id(t): t for t in skeleton.state_dict(keep_vars=True).values()}.values()  # tied ones once
    elements = sum(t.numel() for t in tensors)
    stored = sum(path.stat().st_size for path in weights_files(directory))
    if elements * MIN_BYTES_PER_ELEMENT > stored + SLACK_BYTES:
        raise CheckpointError(
            f"{directory / CONFIG_NAME} describes a {name} of {elements:,} weights, more than its weights files "
            f"({stored:,} bytes) can hold: the config does not belong to these weights",
            "save the model again with save_pretrained, or restore its config.json",
        )


#: an index lists one file name per tensor: tens of MB for the largest models
MAX_INDEX_BYTES = 64 << 20


def check_shard_index(directory: Path) -> None:
    """A shard index names the files transformers reads: each must be a file of this directory (not
    ``../../elsewhere``), so that the SOURCE is the directory the user named and nothing else."""
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = directory / name
        if not path.is_file():
            continue
        problem = None
        try:
            if path.stat().st_size > MAX_INDEX_BYTES:
                problem = f"is {path.stat().st_size:,} bytes, not a shard index"
            else:
                index = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
                files = index.get("weight_map") if isinstance(index, dict) else None
                if not isinstance(files, dict) or not all(isinstance(f, str) for f in files.values()):
                    problem = "has no weight_map of tensor names to file names"
                else:
                    outside = next(
                        (
                            f
                            for f in files.values()
                            if Path(f).name != f or f in ("", ".", "..") or not (directory / f).is_file()
                        ),
                        None,
                    )
                    suffix = ".safetensors" if name.startswith("model.") else ".bin"
                    other = next((f for f in files.values() if not f.endswith(suffix)), None)
                    if outside is not None:
                        problem = f"names {shown(outside, 80)}, which is not a file of the directory"
                    elif other is not None:  # config.json, the index itself: not weights, whatever they hold
                        problem = f"names {shown(other, 80)}, which is not a {suffix} weights file"
        except RepeatedKeyError as error:
            problem = f"repeats the key {shown(error.key, 100)}"
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            problem = f"is not valid JSON ({type(error).__name__})"
        if problem:
            raise CheckpointError(f"{path} {problem}", "save the model again with save_pretrained")


def stored_tensors(directory: Path) -> "dict[str, torch.Tensor]":
    """The directory's weights as stored, memory-mapped (nothing copied), read as bnsurgeon reads any checkpoint:
    no code runs, and the file bounds apply, before transformers reads them."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for path in weights_files(directory):
        if path.name.endswith(".index.json"):
            continue
        try:
            obj = read_checkpoint(path, mmap=True).obj
        except UnsafeCheckpointError:
            raise UnsafeCheckpointError(
                f"{path}: this weights file is a pickle that would run code when loaded",
                "ask for the model saved with save_pretrained (model.safetensors); bnsurgeon never runs code "
                "from a model directory",
            ) from None
        if isinstance(obj, dict):
            tensors.update((key, value) for key, value in obj.items() if isinstance(value, torch.Tensor))
    return tensors


#: layers a config may ask for beyond one per stored tensor (a layer without weights of its own)
SLACK_LAYERS = 16


def check_layer_count(directory: Path, config: dict[str, Any], tensors: "dict[str, torch.Tensor]") -> None:
    """Every layer of a real model stores at least one tensor: a config asking for more layers than its weights
    files hold tensors (depths edited from [3, 4] to [20000, 1]) describes another model, and is refused before
    it is built."""
    layers = layer_count(config)
    if layers > len(tensors) + SLACK_LAYERS:
        raise CheckpointError(
            f"{directory / CONFIG_NAME} asks for {layers:,} layers, more than its weights files hold tensors "
            f"({len(tensors):,}): the config does not belong to these weights",
            "save the model again with save_pretrained, or restore its config.json",
        )


def stored_dtype(tensors: "dict[str, torch.Tensor]") -> "torch.dtype | None":
    """The floating dtype most of the stored weights' elements have (None: no floating weight). config.json's
    dtype is not asked: an edited one would round every weight silently."""
    counts: dict = {}
    for tensor in tensors.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=lambda dtype: counts[dtype]) if counts else None


def check_as_stored(directory: Path, model: "nn.Module", tensors: "dict[str, torch.Tensor]") -> None:
    """Every stored weight is in the model with its value: one whose dtype differs from the model's (a float64
    tensor among float32 weights) must survive the cast exactly, or the directory is refused, naming it."""
    from bnsurgeon.files.weights import refuse_lossy_casts

    expected = model.state_dict()
    refuse_lossy_casts({key: value for key, value in tensors.items() if key in expected}, expected, directory)


def check_loading_info(directory: Path, name: str, info: dict[str, Any]) -> None:
    """from_pretrained only warns where weights do not fit: a missing key is a tensor left at its random
    initial value, an unexpected one a trained tensor dropped. Both are refused; the one exception is the BN
    batch counters of a model saved after training synced (a frozen BN class has no ``num_batches_tracked``,
    and it does not change what frozen BN computes)."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(key for key in info.get("unexpected_keys") or () if not key.endswith("num_batches_tracked"))
    mismatched = sorted(
        str(item[0]) if isinstance(item, (tuple, list)) else str(item) for item in info.get("mismatched_keys") or ()
    )
    for keys, what in ((missing, "lacks"), (mismatched, "has another shape for"), (unexpected, "has weights")):
        if keys:
            detail = "it does not define" if what == "has weights" else "it defines"
            raise WeightsMismatchError(
                f"{directory} {what} {len(keys)} of the weights {name} {detail} ({shown(keys[0], 120)}"
                f"{', ...' if len(keys) > 1 else ''}): from_pretrained would only warn",
                "save the model again with save_pretrained, or check that config.json belongs to these weights",
            )


PREPROCESSOR_FILE = "preprocessor_config.json"


#: no preprocessor_config.json nests deeper (a handful of levels: an object of size objects)
MAX_PREPROCESSOR_DEPTH = 16
#: no side of an image a preprocessor makes is longer (sizes in a config are pixels)
MAX_SIDE = 1 << 16
#: the forms a size takes in a preprocessor_config.json: a number (a square), [height, width], or one of these objects
SIZE_FORMS = (
    {"height", "width"},
    {"shortest_edge"},
    {"shortest_edge", "longest_edge"},
    {"longest_edge"},
    {"max_height", "max_width"},
)
#: the fields that are switches
SWITCHES = (
    "do_resize",
    "do_center_crop",
    "do_rescale",
    "do_normalize",
    "do_convert_rgb",
    "do_pad",
    "keep_aspect_ratio",
)


#: the most digits an integer of a preprocessor config may have (Python refuses to parse past 4,300)
MAX_INTEGER_DIGITS = 30


class LongNumberError(ValueError):
    """An integer with more digits than any size or count: named as such, not as JSON that cannot be read."""

    def __init__(self, digits: int) -> None:
        super().__init__(f"{digits} digits")
        self.digits = digits


def _bounded_integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INTEGER_DIGITS:
        raise LongNumberError(digits)
    return int(text)


def read_preprocessor_text(path: Path) -> str:
    """preprocessor_config.json as data, checked as config.json is: a regular file, bounded in size and nesting, one
    strict JSON object whose keys do not repeat, asking for no remote code (an ``auto_map`` names code from the
    directory), and whose preprocessing fields are values preprocessing can use (``check_preprocessor``). Its text,
    to be used or copied."""
    if not path.is_file():
        raise PreprocessorConfigError(
            f"{path} is not a regular file (a link to a device, a pipe or a folder)",
            "save the image processor again with save_pretrained",
        )
    with open(path, "rb") as file:  # what is read is bounded, whatever the size said a moment before
        raw = file.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise PreprocessorConfigError(
            f"{path} is more than {MAX_CONFIG_BYTES:,} bytes, not a preprocessor config",
            "save the image processor again with save_pretrained",
        )
    try:
        text = raw.decode("utf-8")
        depth = nesting_depth(text)
        if depth > MAX_PREPROCESSOR_DEPTH:
            raise PreprocessorConfigError(
                f"{path} nests {depth:,} levels deep (a preprocessor config nests a few; at most "
                f"{MAX_PREPROCESSOR_DEPTH}); it was not parsed",
                "save the image processor again with save_pretrained",
            )
        value = json.loads(
            text, object_pairs_hook=unique_keys, parse_constant=refuse_constant, parse_int=_bounded_integer
        )
    except LongNumberError as error:
        raise PreprocessorConfigError(
            f"{path} holds a number of {error.digits:,} digits (a size or a count has a few; at most "
            f"{MAX_INTEGER_DIGITS}): not a usable value",
            "save the image processor again with save_pretrained",
        ) from None
    except RepeatedKeyError as error:
        raise CheckpointError(
            f"{path} repeats the key {shown(error.key, 100)}: JSON readers disagree on which "
            "value counts, so bnsurgeon reads neither",
            "keep one entry for the key",
        ) from None
    except NonFiniteConstantError as error:
        raise PreprocessorConfigError(f"{path} holds {error.constant}, which is not a JSON value") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({type(error).__name__})", "save the image processor again with save_pretrained"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object", "save the image processor again with save_pretrained")
    if "auto_map" in value:
        raise ConfirmationError(
            f"{path} asks for remote code (auto_map): bnsurgeon does not import it",
            "pass the preprocessed batches as a tensor file instead of an image folder",
        )
    check_preprocessor(value, path)
    return text


def check_preprocessor(config: dict[str, Any], path: Path) -> None:
    """Every preprocessing field of a preprocessor_config.json that is set holds a value preprocessing can use:
    sizes are whole numbers of pixels from 1 to ``MAX_SIDE`` in one of ``SIZE_FORMS``, ``crop_pct`` is in (0, 1],
    ``image_mean``/``image_std`` are a number or three (one per RGB channel; std above 0), ``rescale_factor`` is
    above 0, the switches are true or false. Refused naming the file and the field (exit 4), before any image
    is read."""

    def refuse(name: str, should: str) -> PreprocessorConfigError:
        return PreprocessorConfigError(
            f"{path}: {name} is {shown(config[name], 80)}; it must be {should}",
            f"fix {name} in {path.name} (or save the image processor again with save_pretrained)",
        )

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def side(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SIDE

    for name in ("size", "crop_size", "pad_size"):
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, dict):
            keys = {key for key, item in value.items() if item is not None}
            fine = keys in SIZE_FORMS and all(side(value[key]) for key in keys)
        elif isinstance(value, list):
            fine = len(value) == 2 and all(side(item) for item in value)
        else:
            fine = side(value)
        if not fine:
            raise refuse(
                name,
                f"a whole number of pixels from 1 to {MAX_SIDE:,}, [height, width], or an object of "
                + " / ".join("{" + ", ".join(sorted(form)) + "}" for form in SIZE_FORMS)
                + " holding such numbers",
            )
    crop_pct = config.get("crop_pct")
    if crop_pct is not None and not (number(crop_pct) and 0 < crop_pct <= 1):
        raise refuse("crop_pct", "a number above 0 and at most 1 (the share of the resized image kept)")
    for name in ("image_mean", "image_std"):
        value = config.get(name)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if len(values) not in (1, 3) or (isinstance(value, list) and len(values) != 3) or not all(map(number, values)):
            raise refuse(name, "a number, or a list of 3 numbers (one per RGB channel)")
        if name == "image_std" and not all(item > 0 for item in values):
            raise refuse(name, "above 0 for every channel (images are divided by it)")
    rescale = config.get("rescale_factor")
    if rescale is not None and not (number(rescale) and rescale > 0):
        raise refuse("rescale_factor", "a number above 0 (1/255 for 8-bit images)")
    largest = _largest_pixel(config)
    if not largest <= MAX_PREPROCESSED:  # a pixel the statistics could not hold: the config's doing, not the data's
        raise refuse(
            "rescale_factor" if (rescale or 0) > 1 else "image_std",
            f"values that keep a preprocessed pixel, (255 x rescale_factor + |image_mean|) / image_std, within "
            f"{MAX_PREPROCESSED:.0e} (these make {largest:.3g})",
        )
    for name in SWITCHES:
        if config.get(name) is not None and not isinstance(config[name], bool):
            raise refuse(name, "true or false")
    resample = config.get("resample")
    if resample is not None and not (
        isinstance(resample, int) and not isinstance(resample, bool) and 0 <= resample <= 5
    ):
        raise refuse("resample", "one of Pillow's resampling filters, 0 to 5")


#: the largest magnitude a preprocessed pixel may reach: its square, summed over a batch, stays finite in float32
MAX_PREPROCESSED = 1e15


def _largest_pixel(config: dict) -> float:
    """How large a preprocessed 8-bit pixel can get under ``config`` (fields already checked as numbers)."""

    def values(name: str, default: float) -> list[float]:
        value = config.get(name, default)
        return [float(item) for item in (value if isinstance(value, list) else [value])]

    rescale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else 1.0
    if not config.get("do_normalize", True):
        return 255 * rescale
    try:
        return (255 * rescale + max(abs(m) for m in values("image_mean", 0.5))) / min(values("image_std", 0.5))
    except (OverflowError, ZeroDivisionError):
        return float("inf")


def image_processor(directory: Path) -> "tuple[Any, str] | None":
    """The model directory's own image preprocessing (its preprocessor_config.json, through transformers'
    AutoImageProcessor, local files only) and a description of it; None where the directory has none."""
    path = directory / PREPROCESSOR_FILE
    if not os.path.lexists(path):
        return None
    read_preprocessor_text(path)
    from transformers import AutoImageProcessor

    try:
        with hub_offline():
            processor = AutoImageProcessor.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=False
            )
    except Exception as error:
        raise CheckpointError(
            f"{path}: transformers cannot build its image processor: {type(error).__name__}: {first_line(error)}",
            "save the image processor again with save_pretrained",
        ) from None
    return processor, f"{type(processor).__name__} from {path}"
