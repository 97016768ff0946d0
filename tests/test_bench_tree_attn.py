"""The kernel benchmark's verify-shape table (CPU: its rows are made up here)."""

from benchmarks.bench_tree_attn import ATTENTION_SHAPES, VERIFY_VARIANTS, verify_markdown


def variant(block_m, block_n, num_warps, ms):
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, ms=ms, rel_error=0.0)


def verify_row(shape, nodes, context, batch, default_ms, fa3_chain_ms, variants, flash=None):
    """One row as ``tune_verify`` writes it (timed from graph replays)."""
    return dict(
        flash_context_ms=flash and flash[0],
        flash_context_rel_error=flash and flash[1],
        shape=shape,
        nodes=nodes,
        context=context,
        batch=batch,
        graphs=True,
        default_ms=default_ms,
        fa3_chain_ms=fa3_chain_ms,
        variants=variants,
    )


def test_the_verify_table_names_the_fastest_variant_and_survives_failed_ones():
    rows = [
        verify_row(
            "qwen3-8b",
            64,
            2048,
            16,
            0.6,
            0.1,
            [variant(16, 64, 4, 0.6), variant(128, 32, 4, 0.45), variant(64, 32, 8, None)],
            flash=(0.15, 2e-3),
        ),
        verify_row("qwen3.6-27b", 16, 384, 1, 0.05, None, [variant(128, 64, 8, None)]),
    ]
    lines = verify_markdown(rows)
    assert "from CUDA-graph replays" in lines[1]
    assert (
        "| qwen3-8b | 64 | 2048 | 16 | 0.6000 | 0.4500 | 128, 32, 4 | 0.1500 (2.0e-03) | 0.1000 "
        "| 6.00 | 4.50 | 1.50 |" in lines
    )
    assert (
        "| qwen3.6-27b | 16 | 384 | 1 | 0.0500 | n/a | every variant failed | n/a | n/a | n/a "
        "| n/a | n/a |" in lines
    )


def test_the_tuned_shapes_cover_the_served_targets():
    assert set(ATTENTION_SHAPES) >= {"qwen3-8b", "smollm2-135m", "qwen3.6-27b"}
    assert (16, 64, 4) in VERIFY_VARIANTS  # the launcher's default for head size 128


def test_the_verify_table_marks_variants_timed_on_the_flashattention_path():
    row = verify_row(
        "qwen3-8b", 16, 384, 16, 0.05, 0.01, [variant(64, 32, 4, 0.02)], flash=(0.024, 3e-3)
    )
    row["variants_path"] = "flash_context"
    lines = verify_markdown([row])
    assert any("| 0.0200 | fa context: 64, 32, 4 | 0.0240 (3.0e-03) |" in line for line in lines)
