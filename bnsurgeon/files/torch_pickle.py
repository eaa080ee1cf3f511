"""torch.save files read without running code, and without touching torch's process-wide allow-list.

torch's ``weights_only`` allow-list (``add_safe_globals``, ``safe_globals``) is one list for the whole process:
widening it for one read, even for the length of one load, widens every other thread's loads meanwhile, and putting
it back races with the program's own changes to it (issue 61). A read here runs torch's own weights_only unpickler,
its code unchanged, against a view of its module's names in which the user's allow-list also holds the read's own
extra globals (``argparse.Namespace`` for timm's training checkpoints). torch's tables and the user's list are read
where they live, at each lookup; nothing of torch's is written.

torch.load takes that unpickler as its ``pickle_module``, which it allows only with ``weights_only=False``; so what
torch does only under ``weights_only=True`` is done here: TorchScript archives and the legacy tar format refused
before torch opens them, sparse tensors validated, refusals reported as torch's weights_only load reports them.
"""

from __future__ import annotations

import os
import pickle
import tarfile
import types
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from bnsurgeon.core.errors import CheckpointError
from bnsurgeon.core.torch_versions import weights_only_refusal

if TYPE_CHECKING:
    import torch

#: what torch reads as true in TORCH_FORCE_WEIGHTS_ONLY_LOAD (2.4 to 2.14 alike)
TRUE_VALUES = ("1", "y", "yes", "true")


def weights_only_forced() -> bool:
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD: torch then refuses any load with an unpickler of the caller's."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in TRUE_VALUES


def global_name(value: Any) -> str:
    """The name a pickle uses for a class or function: ``argparse.Namespace``."""
    return f"{value.__module__}.{value.__qualname__}"


def load_weights_only(
    path: Path, *, also_allowed: Sequence[Any] = (), map_location: Any = "cpu", mmap: bool = False
) -> Any:
    """``torch.load(path, weights_only=True)`` with ``also_allowed`` admitted for this load only.

    What the load accepts: torch's defaults, what the program allowed with ``add_safe_globals`` (as it stands
    while the load runs), and ``also_allowed``; nothing else, on any opcode. Where TORCH_FORCE_WEIGHTS_ONLY_LOAD
    is set, torch's own weights_only load, without ``also_allowed`` (torch accepts no unpickler then).
    """
    import torch

    refuse_what_weights_only_refuses(path)
    if weights_only_forced():
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    sparse: list[torch.Tensor] = []
    unpickling = per_load_unpickling(also_allowed, sparse)
    loaded = torch.load(path, map_location=map_location, pickle_module=unpickling, weights_only=False, mmap=mmap)
    validate_sparse(sparse)
    return loaded


def per_load_unpickling(also_allowed: Sequence[Any], sparse: list["torch.Tensor"]) -> types.ModuleType:
    """A pickle module for torch.load: torch's weights_only ``Unpickler`` and ``load``, whose every lookup of an
    allowed global goes through this load's view (the user's list as it is now, plus ``also_allowed``), and whose
    sparse tensors are also listed in ``sparse`` for ``validate_sparse``.

    torch offers no per-load allow-list, and its unpickler reads the list through module-level functions; so its
    functions are rebuilt over a dict of its module's names with those lookups replaced, which is plain Python
    (``types.FunctionType`` of the same code). ``torch._weights_only_unpickler`` is private: torch has no public
    name for this unpickler.
    """
    import torch
    import torch._weights_only_unpickler as torch_unpickler

    extra = {global_name(value): value for value in also_allowed}
    sparse_rebuild = torch._utils._rebuild_sparse_tensor

    def user_allowed_globals() -> dict[str, Any]:
        """The user's add_safe_globals entries, read now, and this load's own."""
        return {**torch_unpickler._get_user_allowed_globals(), **extra}

    def rebuild_sparse_listed(*args: Any) -> Any:
        tensor = sparse_rebuild(*args)
        sparse.append(tensor)
        return tensor

    # torch's default table (built once by torch, read here), with its sparse rebuild listing what it builds
    table = {
        name: rebuild_sparse_listed if value is sparse_rebuild else value
        for name, value in torch_unpickler._get_allowed_globals().items()
    }

    names = dict(vars(torch_unpickler))
    names["_get_user_allowed_globals"] = user_allowed_globals
    names["_get_allowed_globals"] = lambda: table
    names["_sparse_tensors_to_validate"] = sparse  # torch >= 2.5 lists legacy sparse classes' tensors itself
    methods = {
        name: _rebuilt(value, names)
        for name, value in vars(torch_unpickler.Unpickler).items()
        if isinstance(value, (types.FunctionType, staticmethod, classmethod))
    }
    methods["load"] = _refusals_as_torch_reports_them(methods["load"])
    unpickler = type("PerLoadUnpickler", (torch_unpickler.Unpickler,), methods)
    names["Unpickler"] = unpickler
    module = types.ModuleType("bnsurgeon_per_load_unpickling")  # torch.load reads its __name__ (a dill check)
    module.Unpickler = unpickler  # type: ignore[attr-defined]
    module.load = _rebuilt(torch_unpickler.load, names)  # type: ignore[attr-defined]
    return module


def _rebuilt(value: Any, names: dict[str, Any]) -> Any:
    """A function of torch's unpickler (plain, static or class method) with its global names looked up in
    ``names``."""
    if isinstance(value, (staticmethod, classmethod)):
        return type(value)(_rebuilt(value.__func__, names))
    function = types.FunctionType(value.__code__, names, value.__name__, value.__defaults__, value.__closure__)
    function.__kwdefaults__ = value.__kwdefaults__
    function.__qualname__ = value.__qualname__
    return function


def _refusals_as_torch_reports_them(load: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """What torch's weights_only load turns into an UnpicklingError ("Weights only load failed ... WeightsUnpickler
    error: ..."), the same here: its unpickler's refusals (a RuntimeError on torch 2.4)."""
    refusal = weights_only_refusal()

    def refusals_reported(self: Any) -> Any:
        try:
            return load(self)
        except refusal as error:
            raise pickle.UnpicklingError(f"WeightsUnpickler error: {error}") from None

    return refusals_reported


def validate_sparse(tensors: list["torch.Tensor"]) -> None:
    """Each sparse tensor's indices checked against its size and values, as torch's weights_only load checks them
    (torch >= 2.5 checks them only under weights_only=True): otherwise a later read goes out of bounds. RuntimeError
    naming the fault."""
    import torch

    for tensor in tensors:
        if tensor.layout is torch.sparse_coo:
            # _indices(): the indices as stored; indices() refuses an uncoalesced tensor, the case to check
            indices, values = tensor._indices(), tensor._values()
            torch.sparse_coo_tensor(
                indices, values, tensor.size(), check_invariants=True, is_coalesced=tensor.is_coalesced()
            )
            continue
        rows = tensor.layout in (torch.sparse_csr, torch.sparse_bsr)
        compressed = tensor.crow_indices() if rows else tensor.ccol_indices()
        plain = tensor.col_indices() if rows else tensor.row_indices()
        torch.sparse_compressed_tensor(
            compressed, plain, tensor.values(), tensor.size(), layout=tensor.layout, check_invariants=True
        )


#: the first bytes of a zip archive: torch.load reads such a file as its zip format
ZIP_MAGIC = b"PK\x03\x04"


def refuse_what_weights_only_refuses(path: Path) -> None:
    """What torch.load would not read as data under weights_only: a TorchScript archive (torch.load hands it to
    torch.jit.load; torch 2.4 does even under weights_only=True) and torch's legacy tar format (its members are
    extracted to a temporary directory). Both checks are torch.load's own, made first."""
    with open(path, "rb") as stream:
        zipped = stream.read(len(ZIP_MAGIC)) == ZIP_MAGIC
        if not zipped:
            stream.seek(0)
            try:
                tarfile.open(fileobj=stream, mode="r:", format=tarfile.PAX_FORMAT).close()
            except tarfile.TarError:
                return
            raise CheckpointError(
                f"{path} is in torch's legacy tar format (torch before 0.4), which is read by extracting it",
                "load it once with a current torch, only if you trust it, and save it again: "
                "torch.save(torch.load(path, weights_only=False), 'new.pt')",
            )
    try:
        with zipfile.ZipFile(path) as archive:
            records = [name.partition("/")[2] for name in archive.namelist()]
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # torch's reader finds no archive either, and says so
    if "constants.pkl" in records:
        raise CheckpointError(
            f"{path} is a TorchScript archive (a compiled program, not a checkpoint of tensors)",
            "load it with torch.jit.load only if you trust it, and save its state_dict() with torch.save",
        )


def globals_named(path: Path) -> set[str]:
    """Every global the pickle of a torch.save zip names (``torch.float8_e8m0fnu``), read without unpickling
    anything: for saying why a load failed. Empty for other files; what precedes damage in a damaged pickle."""
    import pickletools

    found: set[str] = set()
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [archive.read(name) for name in archive.namelist() if name.partition("/")[2] == "data.pkl"]
    except (zipfile.BadZipFile, OSError, ValueError, RuntimeError):
        return found
    for data in pickles:
        strings: list[str] = []
        try:
            for opcode, argument, _ in pickletools.genops(data):
                if opcode.name == "GLOBAL" and isinstance(argument, str):
                    found.add(argument.replace(" ", ".", 1))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.add(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(argument, str):
                    strings = [*strings[-1:], argument]
        except Exception:  # noqa: BLE001 - a damaged pickle: what was named before the damage
            continue
    return found
