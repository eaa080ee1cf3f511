"""Where a fused model's error comes from: the fold, or float32 rounding the source has too.

    python scripts/fused_drift.py ese_vovnet99b efficientnetv2_rw_s resnet50

For each timm model (pretrained=False, seed 0, the fused sweep's check input), four max
errors relative to the output scale (max |diff| / max |reference|), eval mode:

- fused32 vs source32: what the sweep and the pre-write check report;
- source32 vs source64: the source's own float32 rounding (same weights, run in float64);
- fused32 vs source64: the fused model's distance from the exact answer;
- fold64 vs source64: the fold done on the float64 model: exact arithmetic up to float64 rounding;
- ulp32 vs source32: the source with every weight moved by half a float32 ulp (w * (1 +- 2^-24),
  signs seeded), the size of change a fold's rounding of w * scale makes: how much this network
  amplifies it.

When fold64 is ~1e-13 the fold is exact; when fused32/src32 is of the order of ulp32/src32, the
gap is the network amplifying float32 rounding of its weights, which any fold in float32 makes.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo_sweep import _build, _input_shapes  # noqa: E402


def _outputs(model, x) -> list:
    import torch

    from bnsurgeon.checks.outputs import flatten_tensors

    with torch.no_grad():
        return flatten_tensors(model.eval()(x.clone()))


def drift(name: str) -> dict:
    import torch

    import bnsurgeon
    from bnsurgeon.checks.fused_check import relative_error
    from bnsurgeon.surgery.fusion import example_tensor

    torch.set_num_threads(1)
    model = _build("timm", name).eval()
    for shape in _input_shapes(model, "timm"):
        shape = (2, *shape[1:])
        try:
            with torch.no_grad():
                model(example_tensor(model, shape))
            break
        except Exception:
            continue
    x32 = example_tensor(model, shape)
    fused32 = bnsurgeon.convert(model, "fused", example_input=shape, allow_unhandled=True).model
    source64 = copy.deepcopy(model).double()
    fused64 = bnsurgeon.convert(source64, "fused", example_input=x32.double(), allow_unhandled=True).model
    exact = _outputs(source64, x32.double())
    row = {"model": name, "shape": list(shape)}
    row["fused32_vs_source32"] = relative_error(_outputs(model, x32), _outputs(fused32, x32))[1]
    row["source32_vs_source64"] = relative_error(exact, _outputs(model, x32))[1]
    row["fused32_vs_source64"] = relative_error(exact, _outputs(fused32, x32))[1]
    row["fold64_vs_source64"] = relative_error(exact, _outputs(fused64, x32.double()))[1]
    row["ratio"] = row["fused32_vs_source64"] / max(row["source32_vs_source64"], 1e-300)
    nudged = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in nudged.parameters():
            if parameter.is_floating_point():
                signs = torch.randint(0, 2, parameter.shape, generator=generator).to(parameter.dtype) * 2 - 1
                parameter.mul_(1 + signs * 2.0**-24)
    row["ulp32_vs_source32"] = relative_error(_outputs(model, x32), _outputs(nudged, x32))[1]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="timm model names")
    args = parser.parse_args()
    print(
        f"{'model':28} {'fused32/src32':>14} {'src32/src64':>12} {'fused32/src64':>14} {'fold64/src64':>13} "
        f"{'ratio':>6} {'ulp32/src32':>12}"
    )
    for name in args.models:
        row = drift(name)
        print(
            f"{name:28} {row['fused32_vs_source32']:14.3g} {row['source32_vs_source64']:12.3g} "
            f"{row['fused32_vs_source64']:14.3g} {row['fold64_vs_source64']:13.3g} {row['ratio']:6.2f} "
            f"{row['ulp32_vs_source32']:12.3g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
