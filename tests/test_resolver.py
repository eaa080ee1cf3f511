"""A SOURCE is resolved once (``bnsurgeon/loading/resolve.py``), and DATA once (``loading/data.py``'s
``resolve_data``): no other code asks a string what it is, the value lists every file reading it opens, and the
steps below take the value."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bnsurgeon"
RESOLVER = "bnsurgeon/loading/resolve.py"
#: DATA's resolver: one function of the module that reads DATA
DATA_RESOLVER = ("bnsurgeon/loading/data.py", "resolve_data")
#: the questions that tell what a SOURCE string is: asked (or defined) only by the resolver. What the resolver
#: offers on the value it made (``bnsurgeon_weights(resolved)``, ``peek(resolved)``: what the file holds) is not one.
QUESTIONS = {
    "looks_like_file",
    "model_directory",
    "is_bnsurgeon_file",
    "bnsurgeon_weights_of",
    "source_inputs",
    "check_source_name",
    "data_files",
}
#: the names a SOURCE or DATA string travels under: none is made a path outside the resolvers
SOURCE_NAMES = {"source", "converted", "data", "spec"}
PATH_CALLS = {"Path", "PurePath", "fspath", "exists", "isdir", "isfile", "lexists", "realpath", "stat"}


def _called(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def source_questions(root: Path) -> list[str]:
    """Every place outside the resolver that interprets a SOURCE string: a call to (an import or a definition of)
    one of ``QUESTIONS``, or a SOURCE variable made a path."""
    found = []
    for path in sorted((root / "bnsurgeon").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where == RESOLVER:
            continue
        tree = ast.parse(path.read_text())
        exempt: set[int] = set()  # the nodes of DATA's resolver
        for node in ast.walk(tree):
            if (where, getattr(node, "name", None)) == DATA_RESOLVER:
                exempt |= {id(inner) for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in exempt:
                continue
            if isinstance(node, ast.Call):
                name = _called(node)
                if name in QUESTIONS:
                    found.append(f"{where}:{node.lineno} calls {name}")
                elif (
                    name in PATH_CALLS
                    and node.args
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in SOURCE_NAMES
                ):
                    found.append(f"{where}:{node.lineno} makes {node.args[0].id} a path ({name})")
            elif isinstance(node, ast.ImportFrom):
                found += [
                    f"{where}:{node.lineno} imports {alias.name}" for alias in node.names if alias.name in QUESTIONS
                ]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in QUESTIONS:
                found.append(f"{where}:{node.lineno} defines {node.name}")
    return found


def test_no_module_outside_the_resolver_interprets_a_source_string():
    assert source_questions(ROOT) == []


def test_the_resolver_asks_the_questions_itself():
    """The scan looks for names the resolver really has: renaming one there would make the scan blind."""
    tree = ast.parse((ROOT / RESOLVER).read_text())
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert {"looks_like_file", "model_directory", "check_source_name"} <= defined


@pytest.mark.parametrize(
    "planted, found, at",
    [
        (
            "def planted(source):\n    return looks_like_file(source)\n",
            "bnsurgeon/pipeline.py:{line} calls looks_like_file",
            2,
        ),
        (
            "def planted(source):\n    from pathlib import Path\n    return Path(source).is_dir()\n",
            "bnsurgeon/pipeline.py:{line} makes source a path (Path)",
            3,
        ),
        (
            "def planted(path):\n    from bnsurgeon.loading.resolve import model_directory\n"
            "    return model_directory(path)\n",
            "bnsurgeon/pipeline.py:{line} imports model_directory",
            2,
        ),
        (
            "def is_bnsurgeon_file(path):\n    return True\n",
            "bnsurgeon/pipeline.py:{line} defines is_bnsurgeon_file",
            1,
        ),
    ],
)
def test_the_scan_catches_a_planted_question(tmp_path, planted, found, at):
    copy = tmp_path / "tree"
    (copy / "bnsurgeon").mkdir(parents=True)
    (copy / "bnsurgeon" / "pipeline.py").write_text((PACKAGE / "pipeline.py").read_text())
    (copy / "bnsurgeon" / "loading").mkdir()
    (copy / "bnsurgeon" / "loading" / "resolve.py").write_text((ROOT / RESOLVER).read_text())
    assert source_questions(copy) == []
    target = copy / "bnsurgeon" / "pipeline.py"
    before = target.read_text() + "\n\n"
    target.write_text(before + planted)
    assert found.format(line=before.count("\n") + at) in source_questions(copy)


def test_the_scan_catches_data_made_a_path_outside_its_resolver(tmp_path):
    copy = tmp_path / "tree"
    (copy / "bnsurgeon" / "loading").mkdir(parents=True)
    data = (PACKAGE / "loading" / "data.py").read_text()
    (copy / "bnsurgeon" / "loading" / "data.py").write_text(data)
    assert source_questions(copy) == []
    planted = "\n\ndef planted(spec):\n    return Path(spec).is_dir()\n"
    (copy / "bnsurgeon" / "loading" / "data.py").write_text(data + planted)
    line = (data + planted).count("\n")  # the planted call is the last line
    assert source_questions(copy) == [f"bnsurgeon/loading/data.py:{line} makes spec a path (Path)"]


def test_data_resolves_once_with_its_files(tmp_path):
    import torch

    from bnsurgeon.loading.data import open_data, resolve_data

    folder = tmp_path / "batches"
    folder.mkdir()
    for index in range(2):
        torch.save(torch.randn(4, 3), folder / f"{index}.pt")
    resolved = resolve_data(str(folder))
    assert resolved.kind == "tensor-folder" and resolved.files == (folder / "0.pt", folder / "1.pt")
    assert resolve_data(resolved) is resolved
    assert sum(len(batch) for batch in open_data(resolved)) == 8
    assert resolve_data("mypkg.data:batches").kind == "function" and resolve_data("mypkg.data:batches").files == ()
    assert resolve_data(str(tmp_path / "missing.pt")).kind == "nothing"


def test_a_name_resolves_without_touching_files(tmp_path, monkeypatch):
    from bnsurgeon.loading.resolve import FACTORY, TIMM, resolve_source

    monkeypatch.chdir(tmp_path)
    timm_name = resolve_source("resnet18")
    assert (timm_name.kind, timm_name.architecture, timm_name.files, timm_name.path) == (TIMM, "resnet18", (), None)
    assert timm_name.inputs() == ["resnet18"]
    factory = resolve_source("mypkg.models:tiny")
    assert factory.kind == FACTORY and factory.trust.factory == "mypkg.models:tiny"
    assert resolve_source(factory) is factory  # a value passes as it is


def test_a_model_directory_lists_every_file_it_reads(tmp_path):
    from bnsurgeon.loading.resolve import CHECKPOINT, DIRECTORY_WEIGHTS, MODEL_DIRECTORY, resolve_source

    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "preprocessor_config.json").write_text("{}")
    (directory / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (directory / "model-00002-of-00002.safetensors").write_bytes(b"x")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    resolved = resolve_source(str(directory))
    assert resolved.kind == MODEL_DIRECTORY and resolved.directory == directory and resolved.names_directory
    assert {path.name for path in resolved.files} == {
        "config.json",
        "preprocessor_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    }
    assert resolved.inputs()[0] == str(directory)  # the SOURCE as typed comes first ("the input file")
    assert all(label == f"a file SOURCE {directory} reads" for _, label in resolved.inputs()[1:])
    assert resolve_source(str(directory / "config.json")).kind == MODEL_DIRECTORY
    shard = directory / "model-00001-of-00002.safetensors"
    assert resolve_source(str(shard)).kind == DIRECTORY_WEIGHTS
    assert not resolve_source(str(shard)).names_directory and resolve_source(str(shard)).as_transformers().directory
    with_model = resolve_source(str(shard), model="resnet18")  # --model: the file itself
    assert with_model.kind == CHECKPOINT and with_model.architecture == "resnet18"


def test_a_checkpoint_lists_the_reports_beside_it(tmp_path):
    from bnsurgeon.loading.resolve import CHECKPOINT, resolve_source

    weights = tmp_path / "m.pt"
    weights.write_bytes(b"x")
    (tmp_path / "m.pt.report.json").write_text("{}")
    resolved = resolve_source(str(weights), role="CONVERTED")
    assert resolved.kind == CHECKPOINT and resolved.trust.pickle
    assert resolved.files == (weights, tmp_path / "m.pt.report.json")
    assert resolved.inputs()[1] == (weights, f"a file CONVERTED {weights} reads")


def test_the_loaded_source_carries_the_value_its_file_told(tmp_path):
    import timm
    import torch

    from bnsurgeon.loading.resolve import BNSURGEON, STATE_DICT, TIMM, TRAINING_CHECKPOINT, resolve_source
    from bnsurgeon.loading.sources import load_source
    from bnsurgeon.pipeline import convert_source

    assert load_source(resolve_source("resnet18"), meta=True).source.kind == TIMM
    state = tmp_path / "r18.safetensors"
    convert_source("resnet18", state, check=False)
    loaded = load_source(resolve_source(str(state)), meta=True)
    assert loaded.source.kind == BNSURGEON and loaded.source.trust.recorded and loaded.source.weights == state
    assert loaded.source.architecture == "timm:resnet18"  # what the file names, once read
    assert pickle.loads(pickle.dumps(loaded.source)) == loaded.source  # a plain value: it can go to another process
    plain = tmp_path / "plain.pt"
    torch.save(timm.create_model("resnet18").state_dict(), plain)
    assert load_source(resolve_source(str(plain), model="resnet18"), model="resnet18").source.kind == STATE_DICT
    training = tmp_path / "train.pth"
    torch.save({"arch": "resnet18", "state_dict": timm.create_model("resnet18").state_dict()}, training)
    assert load_source(resolve_source(str(training)), meta=True).source.kind == TRAINING_CHECKPOINT


def test_the_commands_and_load_take_the_value(tmp_path):
    import bnsurgeon
    from bnsurgeon.api import inspect, resolve_source
    from bnsurgeon.pipeline import convert_source

    resolved = resolve_source("resnet18")
    assert inspect(resolved).to_dict() == inspect("resnet18").to_dict()
    out = tmp_path / "r18.sync.safetensors"
    outcome = convert_source(resolved, out, check=False)
    assert outcome.result.report.source == "timm:resnet18" and outcome.loaded.source is resolved
    rebuilt = bnsurgeon.load(resolve_source(str(out)))
    assert type(rebuilt).__name__ == "ResNet"
    # the value's file list is what the output check reads: the SOURCE itself is never an output, --force or not
    with pytest.raises(bnsurgeon.OutputError, match="is the input file"):
        convert_source(resolve_source(str(out)), out, check=False, force=True)
