"""The Markdown report: summary first, paths collapsed by pattern, children per pattern."""

from bnsurgeon.surgery.report import ModuleChange, Report, collapse_paths


def test_paths_collapse_by_numeric_components():
    assert collapse_paths(["blocks.0.1.bn1", "blocks.2.0.bn1", "bn1", "0.bn"]) == [
        ("blocks.*.*.bn1", 2),
        ("*.bn", 1),
        ("bn1", 1),
    ]


def test_markdown_summary_first_and_children_per_pattern():
    report = Report(
        target="sync",
        changed=[
            ModuleChange("blocks.0.0.bn1", [], "timm.BatchNormAct2d", "bnsurgeon.SyncBatchNormAct", "r", ["act=SiLU"]),
            ModuleChange(
                "blocks.1.0.bn3", [], "timm.BatchNormAct2d", "bnsurgeon.SyncBatchNormAct", "r", ["act=Identity"]
            ),
        ],
    )
    text = report.to_markdown()
    assert text.index("**2 modules converted**") < text.index("### BatchNormAct2d -> SyncBatchNormAct (2)")
    assert "| `blocks.*.*.bn1` | 1 | act=SiLU |" in text
    assert "| `blocks.*.*.bn3` | 1 | act=Identity |" in text
