"""Trust, round six (issue 61, class C): a read is a guest in the user's process.

Reading a ``.pt``/``.pth`` admits ``argparse.Namespace`` (timm training checkpoints) for that one load and changes
nothing anyone else sees: torch's ``weights_only`` allow-list, another thread's own loads, entries the program adds
meanwhile, on every supported torch. And a ``.pt`` holding a dtype newer than the installed torch is exit 18 naming
both versions, as the same tensors in a ``.safetensors`` file are, with or without ``--trust-pickle``.

The threaded tests start their threads at a barrier, run a bounded number of loads (a second or two) and switch
threads often, so that the old reads (the allow-list widened for the length of a load) fail every run.
"""

from __future__ import annotations

import argparse
import io
import pickle
import sys
import tarfile
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_untrusted import one_line_failure, run, tiny  # noqa: F401 (fixtures)

from bnsurgeon.core import torch_versions
from bnsurgeon.files.reading import read_checkpoint

#: loads per thread: enough that the old reads fail every run, few enough for a second or two
LOADS = 150
#: entries the program adds to its allow-list while the reads run (each read's lookups go through them all)
ENTRIES = 200


def allow_list() -> set:
    """What torch's weights_only loads accept beyond their defaults, as a value (2.4 returns its live list)."""
    return set(torch.serialization.get_safe_globals())


@contextmanager
def threads_switching_often():
    """Threads take turns every 20 us instead of every 5 ms, so that a load in one thread is interleaved with the
    others as a data-loading pool or a server interleaves them."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@contextmanager
def allow_list_restored():
    """The test's own entries go when it ends, whatever the code under test did to the list."""
    before = list(torch.serialization.get_safe_globals())
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


@pytest.fixture(autouse=True)
def _allow_list_as_it_was():
    """No test here leaves the allow-list changed for the tests after it (the old reads could)."""
    with allow_list_restored():
        yield


def run_together(*workers) -> None:
    """Each worker in a thread of its own, all started at one barrier; the first error in a worker fails the test."""
    barrier = threading.Barrier(len(workers))
    errors: list[BaseException] = []

    def started(worker):
        def body():
            barrier.wait()
            try:
                worker()
            except BaseException as error:  # noqa: BLE001 (reported by the test below)
                errors.append(error)

        return body

    threads = [threading.Thread(target=started(worker)) for worker in workers]
    with threads_switching_often():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a worker did not finish"
    if errors:
        raise errors[0]


@pytest.fixture
def timm_checkpoint(tmp_path) -> Path:
    """What timm's train.py writes: weights, and its arguments as an argparse.Namespace."""
    path = tmp_path / "last.pth.tar"
    torch.save(
        {"epoch": 3, "arch": "resnet18", "state_dict": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, path
    )
    return path


@pytest.fixture
def namespace_file(tmp_path) -> Path:
    """A file the user's own code loads with torch.load(weights_only=True): torch refuses its Namespace."""
    path = tmp_path / "theirs.pt"
    torch.save({"args": argparse.Namespace(x=1)}, path)
    return path


def test_reads_in_threads_change_nothing_that_another_threads_loads_accept(timm_checkpoint, namespace_file):
    """Two threads read a timm checkpoint while a third loads a Namespace with torch's own weights_only loader and
    a fourth samples torch's allow-list: every read succeeds, every one of the other thread's loads is refused,
    and the allow-list never changes (the old reads widened it for each load: the other thread's loads were
    accepted, and a read ending in one thread took Namespace away from a read under way in the other)."""
    with pytest.raises(pickle.UnpicklingError):
        torch.load(namespace_file, weights_only=True)  # torch's default, before any read
    initial = allow_list()
    done = threading.Event()
    read_failures: list[str] = []
    their_accepted: list[int] = []
    their_errors: list[str] = []
    changes: list[set] = []

    def reads():
        for _ in range(LOADS):
            try:
                raw = read_checkpoint(timm_checkpoint)
            except Exception as error:  # noqa: BLE001 (counted: every read must succeed)
                read_failures.append(f"{type(error).__name__}: {error}")
            else:
                assert isinstance(raw.obj["args"], argparse.Namespace) and raw.obj["args"].lr == 0.1

    def their_loads():
        for index in range(LOADS):
            try:
                torch.load(namespace_file, weights_only=True)
            except pickle.UnpicklingError:
                continue
            except Exception as error:  # noqa: BLE001 (torch's own list changing under its lookups: a KeyError)
                their_errors.append(f"{type(error).__name__}: {error}")
                continue
            their_accepted.append(index)

    def samples():
        while not done.is_set():
            now = allow_list()
            if now != initial:
                changes.append(now)

    sampler = threading.Thread(target=samples)
    sampler.start()
    try:
        run_together(reads, reads, their_loads)
    finally:
        done.set()
        sampler.join()
    counts = {
        "reads failed": len(read_failures),
        "their loads accepted Namespace": len(their_accepted),
        "their loads failed otherwise": len(their_errors),
        "allow-list changes sampled": len(changes),
    }
    first = (read_failures + their_errors)[:1]
    assert set(counts.values()) == {0}, f"{counts} (of {2 * LOADS} reads, {LOADS} of their loads); first: {first}"
    assert allow_list() == initial


def test_entries_the_program_adds_from_another_thread_stay(timm_checkpoint):
    """The program allows globals of its own (argparse.Namespace first) while reads run in two other threads: every
    entry stays from the moment it is added (the old reads removed Namespace when they ended, also the program's
    own; their removal raced with the program's additions; on torch 2.4 they cleared the list and put back what it
    held before the read, erasing whatever was added meanwhile)."""
    added: list = []
    missing: set[str] = set()
    misses = 0
    read_failures: list[str] = []
    reading = threading.Event()
    finished: list[int] = []

    def reads():
        for _ in range(LOADS):
            try:
                read_checkpoint(timm_checkpoint)
            except Exception as error:  # noqa: BLE001 (counted: every read must succeed)
                read_failures.append(f"{type(error).__name__}: {error}")
            reading.set()
        finished.append(1)

    def program():
        """Namespace, then a class of its own at each step (up to ENTRIES), each checked at every step after."""
        nonlocal misses
        reading.wait(timeout=60)  # the reads are under way
        while len(finished) < 2:
            if len(added) < ENTRIES:
                entries = [type(f"Mine{len(added)}", (), {})] if added else [argparse.Namespace]
                torch.serialization.add_safe_globals(entries)
                added.extend(entries)
            now = allow_list()
            gone = [entry.__name__ for entry in added if entry not in now]
            missing.update(gone)
            misses += bool(gone)

    run_together(reads, reads, program)
    final = allow_list()
    assert len(added) > 10, "the program added too little while the reads ran to test anything"
    assert missing == set(), f"entries the program added were missing at {misses} checks: {sorted(missing)[:5]}"
    assert [entry for entry in added if entry not in final] == []
    assert read_failures == [], f"{len(read_failures)} of {2 * LOADS} reads failed, first: {read_failures[0]}"


class Schedule:
    """A class of the program's own, which it allows for its loads with add_safe_globals."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs


def test_a_read_admits_namespace_for_itself_only_and_leaves_the_users_entries_in_force(timm_checkpoint, tmp_path):
    """One thread, step by step: a read accepts the timm checkpoint, torch's own loader still refuses its Namespace
    afterwards, and what the program allowed itself is accepted by the read too (the read adds to the program's
    list for itself; it never narrows it)."""
    before = allow_list()
    assert isinstance(read_checkpoint(timm_checkpoint).obj["args"], argparse.Namespace)
    assert allow_list() == before
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):
        torch.load(timm_checkpoint, weights_only=True)
    scheduled = tmp_path / "scheduled.pt"
    torch.save({"w": torch.ones(1), "schedule": Schedule(90), "args": argparse.Namespace(a=1)}, scheduled)
    with pytest.raises(Exception, match="Schedule"):
        read_checkpoint(scheduled)
    torch.serialization.add_safe_globals([Schedule])
    loaded = read_checkpoint(scheduled).obj
    assert loaded["schedule"].epochs == 90 and loaded["args"].a == 1
    assert allow_list() == before | {Schedule}


# ---- what torch's weights_only loader refuses, the per-load reader refuses ----------------------------------------


@pytest.mark.parametrize("flag", ["SOURCE", "--example-input"])
def test_a_torchscript_archive_is_refused_as_code_without_being_loaded(tiny, monkeypatch, flag):
    """torch.load hands a TorchScript archive to torch.jit.load (2.4 even under weights_only=True): never here."""
    import warnings

    with warnings.catch_warnings():  # torch.jit.script is deprecated in the newest torch
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(torch.nn.Linear(2, 2))
    path = tiny / "scripted.pt"
    scripted.save(str(path))

    def loaded(*args, **kwargs):
        raise AssertionError("torch.jit.load ran")

    monkeypatch.setattr(torch.jit, "load", loaded)
    if flag == "SOURCE":
        one_line_failure(run("inspect", path), 4, f"{path} is a TorchScript archive")
    else:
        result = run("convert", "tiny:build", "-o", tiny / "o.safetensors", "--example-input", path)
        one_line_failure(result, 2, f"{path} is a TorchScript archive")


def test_torchs_legacy_tar_format_is_refused_before_anything_is_extracted(tiny, monkeypatch):
    """torch's pre-0.4 tar format is refused (torch >= 2.5 refuses it under weights_only): reading it would extract
    the archive's members into a temporary directory."""
    path = tiny / "old.pt"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for name in ("sys_info", "pickle", "storages", "tensors"):
            data = pickle.dumps(0, protocol=2)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))

    def extracted(*args, **kwargs):
        raise AssertionError("a tar member was extracted")

    monkeypatch.setattr(tarfile.TarFile, "extract", extracted)
    one_line_failure(run("inspect", path), 4, "torch's legacy tar format")


def test_a_sparse_tensor_whose_indices_point_outside_it_is_refused(tiny):
    """torch's weights_only loader validates sparse tensors (their indices would read outside the values later);
    the per-load reader does too, at every torch."""
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (2,), check_invariants=True)
    bad._indices().fill_(7)  # past the tensor's size: torch.sparse_coo_tensor would refuse these indices
    path = tiny / "sparse.pt"
    torch.save({"w": torch.ones(2), "grad": bad}, path)
    one_line_failure(run("inspect", path), 4, "sparse.pt is not a readable PyTorch checkpoint")
    good = tiny / "good_sparse.pt"
    fine = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (2,), check_invariants=True)
    torch.save({"w": torch.ones(2), "grad": fine}, good)
    assert read_checkpoint(good).obj["grad"].layout == torch.sparse_coo


def test_torch_force_weights_only_load_still_reads_plain_checkpoints(tiny, timm_checkpoint, monkeypatch):
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD makes torch refuse a load with its own unpickler: a read is then torch's
    weights_only load itself (what the variable asks for), and a Namespace it cannot admit is named with the fix."""
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    path = tiny / "plain.pt"
    torch.save({"w": torch.ones(2)}, path)
    assert torch.equal(read_checkpoint(path).obj["w"], torch.ones(2))
    before = allow_list()
    one_line_failure(run("inspect", timm_checkpoint), 5, "argparse.Namespace", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    assert allow_list() == before


# ---- dtypes newer than the installed torch ---------------------------------------------------------------------

#: torch feature (core/torch_versions.py) -> a dtype of the floor with as many bytes per element, whose name the
#: test replaces in the pickle: the file is then what the newer torch writes for that dtype
STAND_INS = {"float8_e8m0fnu": "float8_e4m3fn", "float4_e2m1fn_x2": "float8_e5m2"}


def saved_with_dtype(path: Path, feature: str, state: dict[str, torch.Tensor], key: str) -> Path:
    """``state`` saved with tensor ``key`` of dtype ``feature``, written by whatever torch runs the test: a torch
    without the dtype saves the stand-in, and the pickle then names the dtype as torch.save of the newer one does."""
    stand_in = getattr(torch, STAND_INS[feature])
    tensors = dict(state)
    tensors[key] = torch.zeros(4, dtype=torch.uint8).view(stand_in)
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for record in source.infolist():
            data = source.read(record)
            if record.filename.endswith("/data.pkl"):
                data = data.replace(f"torch\n{STAND_INS[feature]}\n".encode(), f"torch\n{feature}\n".encode())
                assert f"torch\n{feature}\n".encode() in data
            out.writestr(record, data)
    return path


@pytest.mark.parametrize("feature", ["float8_e8m0fnu", "float4_e2m1fn_x2"])
@pytest.mark.parametrize("trust", [False, True])
def test_a_pt_holding_a_dtype_newer_than_torch_is_exit_18_as_in_safetensors(tiny, feature, trust):
    """On a torch without the dtype: one line, exit 18, naming the dtype and both versions (before: "would run
    code, pass --trust-pickle", then, with it, "corrupt"). On one with it: the file is read."""
    import tiny as tiny_module

    path = saved_with_dtype(tiny / "w.pt", feature, tiny_module.build().state_dict(), "extra")
    flags = ["--trust-pickle"] if trust else []
    result = run("inspect", path, *flags)
    if torch_versions.has(feature):
        assert result.exit_code == 0, result.output
        assert read_checkpoint(path, trust_pickle=trust).obj["extra"].dtype == getattr(torch, feature)
        return
    needed = torch_versions.needed(feature)
    one_line_failure(
        result, 18, f"{path} (it holds {feature} tensors) needs torch >= {needed} (you have {torch.__version__})"
    )
    assert "would run code" not in result.output and "corrupt" not in result.output
    result = run(
        "convert", path, "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8", *flags
    )
    one_line_failure(result, 18, f"needs torch >= {needed}")
    assert not (tiny / "o.safetensors").exists()


def test_an_example_input_of_a_dtype_newer_than_torch_is_exit_18(tiny):
    """--example-input reads with torch's weights_only loader: a dtype this torch lacks is named the same way."""
    feature = "float8_e8m0fnu"
    path = saved_with_dtype(tiny / "x.pt", feature, {}, "x")
    result = run("convert", "tiny:build", "-o", tiny / "o.safetensors", "--example-input", path)
    if torch_versions.has(feature):
        assert "would run code" not in result.output
        return
    one_line_failure(result, 18, f"(it holds {feature} tensors) needs torch >= {torch_versions.needed(feature)}")
