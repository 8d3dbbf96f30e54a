import gzip

import numpy as np
import pytest
import torch

from gpnys import datasets


def test_bundled_sets_load_and_standardise():
    assert {"elevators", "energy", "concrete", "airfoil", "synthetic3d"} <= set(datasets.available())
    ds = datasets.load("energy", split=3)
    data, mask = datasets.load_array("energy")
    assert ds.n == int((~mask[:, 3]).sum()) and ds.test_x.shape[0] == int(mask[:, 3].sum())
    assert ds.d == data.shape[1] - 1
    torch.testing.assert_close(ds.train_x.mean(0), torch.zeros(ds.d, dtype=ds.train_x.dtype), atol=1e-10, rtol=0)
    torch.testing.assert_close(ds.train_y.std(), torch.tensor(1.0, dtype=torch.float64))
    # the transform maps back to the file's values
    test_rows = np.flatnonzero(mask[:, 3])
    torch.testing.assert_close(ds.transform.inverse_y(ds.test_y), torch.as_tensor(data[test_rows, -1]))


def test_splits_are_disjoint_and_differ():
    a, b = datasets.load("concrete", split=0), datasets.load("concrete", split=1)
    assert not torch.equal(a.test_y, b.test_y)
    data, mask = datasets.load_array("concrete")
    assert mask.shape == (data.shape[0], 10)


def test_subsample_is_seeded(dtype):
    a = datasets.load("airfoil", n=300, seed=4, dtype=dtype)
    b = datasets.load("airfoil", n=300, seed=4, dtype=dtype)
    c = datasets.load("airfoil", n=300, seed=5, dtype=dtype)
    assert a.n == 300 and a.subsampled and a.train_x.dtype == dtype
    assert torch.equal(a.train_x, b.train_x)
    assert not torch.equal(a.train_x, c.train_x)


def test_no_standardize_keeps_raw_values():
    ds = datasets.load("energy", standardize=False)
    data, mask = datasets.load_array("energy")
    torch.testing.assert_close(ds.train_y, torch.as_tensor(data[~mask[:, 0], -1]))


def _write(path, rows):
    with gzip.open(path, "wt") as fh:
        for r in rows:
            fh.write(",".join(str(v) for v in r) + "\n")


def test_csv_path_without_mask_gets_seeded_splits(tmp_path):
    rng = np.random.default_rng(0)
    _write(tmp_path / "data.csv.gz", rng.normal(size=(50, 3)))
    ds = datasets.load(tmp_path / "data.csv.gz", split=2)
    assert ds.n + ds.test_x.shape[0] == 50 and ds.test_x.shape[0] == 5
    assert torch.equal(ds.test_y, datasets.load(str(tmp_path), split=2).test_y)


def test_plain_csv_with_mask(tmp_path):
    rng = np.random.default_rng(1)
    np.savetxt(tmp_path / "data.csv", rng.normal(size=(20, 2)), delimiter=",")
    mask = np.zeros((20, 10), dtype=int)
    mask[:4, :] = 1
    np.savetxt(tmp_path / "test_mask.csv", mask, delimiter=",", fmt="%d")
    ds = datasets.load(tmp_path / "data.csv", split=9)
    assert ds.test_x.shape == (4, 1) and ds.n == 16


@pytest.mark.parametrize(
    "rows, message",
    [([[1.0, float("nan")], [2.0, 3.0]], "NaN"), ([[1.0, float("inf")], [2.0, 3.0]], "NaN/inf"), ([[1.0], [2.0]], "2 columns")],
)
def test_bad_files(tmp_path, rows, message):
    _write(tmp_path / "data.csv.gz", rows)
    with pytest.raises(ValueError, match=message):
        datasets.load(tmp_path / "data.csv.gz")


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        datasets.load("energy", split=10)
    with pytest.raises(ValueError, match="split"):
        datasets.load("energy", split=-1)
    with pytest.raises(ValueError, match="n=100000"):
        datasets.load("energy", n=100000)
    with pytest.raises(ValueError, match="n must be"):
        datasets.load("energy", n=0)
    with pytest.raises(ValueError, match="neither a bundled"):
        datasets.load("no-such-set")
    with pytest.raises(ValueError, match="n is required"):
        datasets.load("synthetic3d")


def test_synthetic3d_unit_density_and_seed():
    ds = datasets.load("synthetic3d", n=900, seed=3, standardize=False)
    assert ds.n == 900 and ds.d == 3
    total = ds.n + ds.test_x.shape[0]
    edge = total ** (1 / 3)
    assert float(ds.train_x.min()) >= 0 and float(ds.train_x.max()) <= edge
    again = datasets.load("synthetic3d", n=900, seed=3, standardize=False)
    assert torch.equal(ds.train_x, again.train_x)
