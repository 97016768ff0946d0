"""Statistics shared by the sampling tests."""

import torch


def chi_square_p_value(counts_a, counts_b) -> float:
    """Two-sample chi-square homogeneity test on category counts (p-value)."""
    a = torch.as_tensor(counts_a, dtype=torch.float64)
    b = torch.as_tensor(counts_b, dtype=torch.float64)
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total, n_a, n_b = a + b, a.sum(), b.sum()
    expected_a, expected_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    stat = (((a - expected_a) ** 2) / expected_a + ((b - expected_b) ** 2) / expected_b).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))
