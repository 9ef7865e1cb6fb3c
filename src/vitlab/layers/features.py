"""timm's ``forward_intermediates`` conventions: which blocks / stages to return and how far to run."""

from __future__ import annotations

OUTPUT_FMTS = ("NCHW", "NLC")


def feature_take_indices(num_blocks: int, indices: int | list[int] | None) -> list[int]:
    """timm's convention: None -> every block, int n -> the last n blocks, list -> those (negatives allowed)."""
    if indices is None:
        return list(range(num_blocks))
    if isinstance(indices, int):
        if not 0 < indices <= num_blocks:
            raise ValueError(f"indices={indices} must be in 1..{num_blocks}")
        return list(range(num_blocks - indices, num_blocks))
    out = [i % num_blocks if -num_blocks <= i < num_blocks else None for i in indices]
    if None in out:
        raise ValueError(f"feature indices {list(indices)} out of range for {num_blocks} blocks")
    return out


def intermediates_plan(num_levels: int, indices: int | list[int] | None, output_fmt: str, stop_early: bool,
                       intermediates_only: bool) -> tuple[list[int], int]:
    """Check ``output_fmt``, resolve ``indices`` over ``num_levels`` blocks / stages and return ``(take, last)``:
    the levels to return and the last level to run (the last taken one when stopping early or returning only
    the intermediates, else the last of all)."""
    if output_fmt not in OUTPUT_FMTS:
        raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
    take = feature_take_indices(num_levels, indices)
    last = max(take) if (stop_early or intermediates_only) else num_levels - 1
    return take, last
