#!/usr/bin/python3
"""Fashion-MNIST through the image-folder path: the Debian package's idx files written out as a
torchvision-style folder of PNG files (OUT/png/{train,test}/<class>/<n>.png, with PIL), converted by
`dtrain convert images --size 28 --channels 1`, and checked against `dtrain convert fashion-mnist`
of the same files:
  - the two conversions hold the same samples: the same multiset of (pixels, label) pairs (28 x 28
    images are not resampled, PNG is lossless; only the order differs, shuffled by --seed);
  - SimpleCNN (examples/fashion_cnn.ini) trained --epochs on each reaches the same test accuracy
    within run-to-run noise (the sample order differs).
Prints the conversion times and the accuracies.

  /usr/bin/python3 benchmarks/peers/image_folder_fashion.py --dtrain build/dtrain --out runs/image_folder_fashion
"""
import argparse
import gzip
import os
import re
import subprocess
import sys
import time

import h5py
import numpy as np
from PIL import Image

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCE = "/usr/share/datasets/fashion-mnist"
CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot"]


def idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    rank = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * rank).reshape(dims)


def source_file(stem):
    for name in (stem + ".gz", stem):
        if os.path.exists(os.path.join(SOURCE, name)):
            return os.path.join(SOURCE, name)
    sys.exit("missing %s in %s" % (stem, SOURCE))


def read_shards(directory):
    xs, ys = [], []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".h5"):
            with h5py.File(os.path.join(directory, name), "r") as f:
                xs.append(f["inputs"][...].reshape(len(f["labels"]), -1))
                ys.append(f["labels"][...])
    return np.concatenate(xs), np.concatenate(ys)


def same_samples(a, b):
    """Whether two (pixels, labels) sets hold the same multiset of samples."""
    def keyed(x, y):
        rows = np.concatenate([x, y.astype(np.uint8)[:, None]], axis=1)
        return rows[np.lexsort(rows.T[::-1])]
    return a[0].shape == b[0].shape and np.array_equal(keyed(*a), keyed(*b))


def sh(cmd):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout + out.stderr, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "image_folder_fashion"))
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()

    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = idx(source_file(prefix + "-images-idx3-ubyte"))
        labels = idx(source_file(prefix + "-labels-idx1-ubyte"))
        for c in CLASSES:
            os.makedirs(os.path.join(a.out, "png", split, c), exist_ok=True)
        for i, (img, label) in enumerate(zip(images, labels)):
            Image.fromarray(img, "L").save(os.path.join(a.out, "png", split, CLASSES[label], "%05d.png" % i))

    _, idx_s = sh([a.dtrain, "convert", "fashion-mnist", "--out", os.path.join(a.out, "idx")])
    png_s = 0.0
    for split in ("train", "test"):
        _, s = sh([a.dtrain, "convert", "images", "--root", os.path.join(a.out, "png", split), "--size", "28",
                   "--channels", "1", "--out", os.path.join(a.out, "folder", split)])
        png_s += s
    # The class folders sort by name, the idx labels follow Fashion-MNIST's order: compare by name.
    remap = np.array([sorted(CLASSES).index(c) for c in CLASSES])
    identical = True
    for s in ("train", "test"):
        x, y = read_shards(os.path.join(a.out, "idx", s))
        identical = identical and same_samples((x, remap[y]), read_shards(os.path.join(a.out, "folder", s)))

    accuracy = {}
    for name in ("idx", "folder"):
        out, _ = sh([a.dtrain, "train", "--config", os.path.join(ROOT, "examples", "fashion_cnn.ini"),
                     "--data", os.path.join(a.out, name, "train"), "--test-data", os.path.join(a.out, name, "test"),
                     "--epochs", str(a.epochs), "--progress", "off", "--metrics", os.path.join(a.out, name + ".jsonl")])
        accuracy[name] = float(re.findall(r"test accuracy ([\d.]+)%", out)[-1])
    print("70,000 PNG files: dtrain convert images %.1f s, dtrain convert fashion-mnist (idx) %.1f s" % (png_s, idx_s))
    print("same samples (pixels and class) in both: %s" % ("yes" if identical else "NO"))
    print("SimpleCNN, %d epochs, test accuracy: idx %.2f %%, image folder %.2f %%"
          % (a.epochs, accuracy["idx"], accuracy["folder"]))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
