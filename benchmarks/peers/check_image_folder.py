#!/usr/bin/python3
"""`dtrain convert images` against PIL, the loader behind torchvision's ImageFolder.

Makes a class-per-folder tree of synthetic photographs (smooth colour fields with noise and edges,
random sizes, JPEG and PNG, grey, RGBA and CMYK among them), converts it with dtrain, and prepares
every image the way torchvision's `Resize(S)` + `CenterCrop(S)` does on PIL (shorter side to S with
PIL's antialiased bilinear filter, the longer side truncated, the centre crop rounded), twice for a
JPEG: as torchvision does (full decode) and with PIL's `draft` (the scaled inverse DCT that dtrain
uses for a JPEG at least twice the output size). The shards do not name their files (the samples
are shuffled), so each dtrain sample is matched to the closest PIL image of its class; the match
must be one-to-one.

Prints the pixel differences per kind of file, and the throughput of dtrain (all its threads) and
of PIL in a process pool of the same size, both from the same files in the page cache.

  /usr/bin/python3 benchmarks/peers/check_image_folder.py --dtrain build/dtrain [--images 1200] [--size 64]
Exit status 0 when every PNG and every draft-decoded JPEG is within 1 of dtrain's value.
"""
import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import h5py
    import numpy as np
    from PIL import Image
except ImportError as e:  # the test that runs this skips (77) where they are not installed
    print("check_image_folder: skipped: %s (python3-h5py, python3-numpy, python3-pil)" % e)
    sys.exit(77)


def synthetic_photo(rng, w, h):
    """A smooth colour field with edges and noise: compresses and resamples like a photograph."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 6, 2).tolist() + [rng.uniform(0, 6.3)]
        img[..., c] = 128 + 90 * np.sin(x / w * fx * 3.1416 + phase) * np.cos(y / h * fy * 3.1416)
    for _ in range(3):  # rectangles: hard edges
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        img[y0:y0 + h // 4, x0:x0 + w // 4] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def make_tree(root, n_images, classes, size, seed):
    """root/class_k/*.{jpg,png}; returns [(path, label, kind)]."""
    rng = np.random.default_rng(seed)
    files = []
    for i in range(n_images):
        label = i % classes
        d = os.path.join(root, "class_%d" % label)
        os.makedirs(d, exist_ok=True)
        # Sizes from below the output (enlarged) to 6x it (JPEG decoded at 1/2 or 1/4).
        w, h = (int(v) for v in rng.integers(size * 3 // 4, size * 6, 2))
        img = synthetic_photo(rng, w, h)
        kind = ["jpeg", "png", "jpeg-grey", "png-rgba", "jpeg-cmyk", "png-grey"][i % 6]
        path = os.path.join(d, "%05d.%s" % (i, "jpg" if kind.startswith("jpeg") else "png"))
        if kind == "jpeg":
            img.save(path, quality=90)
        elif kind == "jpeg-grey":
            img.convert("L").save(path, quality=90)
        elif kind == "jpeg-cmyk":
            img.convert("CMYK").save(path, quality=90)
        elif kind == "png":
            img.save(path)
        elif kind == "png-rgba":
            rgba = img.convert("RGBA")
            rgba.putalpha(255)
            rgba.save(path)
        else:
            img.convert("L").save(path)
        files.append((path, label, kind))
    return files


def torchvision_like(path, size, draft):
    """What torchvision's Resize(size) + CenterCrop(size) give for PIL's image of `path`, CHW."""
    img = Image.open(path)
    if draft and img.format == "JPEG":
        img.draft("RGB", (size, size))
    img = img.convert("RGB")
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    img = img.resize((new_w, new_h), Image.BILINEAR)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    img = img.crop((left, top, left + size, top + size))
    return np.asarray(img, np.uint8).transpose(2, 0, 1)


def _pil_job(args):
    path, size = args
    return torchvision_like(path, size, draft=False)


def read_shards(out):
    inputs, labels = [], []
    for name in sorted(os.listdir(out)):
        if name.endswith(".h5"):
            with h5py.File(os.path.join(out, name), "r") as f:
                inputs.append(f["inputs"][...])
                labels.append(f["labels"][...])
    return np.concatenate(inputs), np.concatenate(labels)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", required=True)
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", help="keep the tree and shards here (default: a temporary directory)")
    a = ap.parse_args()

    work = a.workdir or tempfile.mkdtemp(prefix="dtrain-images-")
    root, out = os.path.join(work, "root"), os.path.join(work, "shards")
    shutil.rmtree(root, ignore_errors=True)
    files = make_tree(root, a.images, a.classes, a.size, a.seed)

    # Throughput, both from the page cache: a warm-up read of every file first.
    for path, _, _ in files:
        with open(path, "rb") as f:
            f.read()
    # dtrain's start (MPI's singleton start-up), measured apart: a few hundred ms here.
    t0 = time.perf_counter()
    subprocess.run([a.dtrain, "convert", "images", "--help"], check=True, stdout=subprocess.DEVNULL)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([a.dtrain, "convert", "images", "--root", root, "--size", str(a.size), "--out", out,
                    "--threads", str(a.threads)], check=True, stdout=subprocess.DEVNULL)
    dtrain_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with multiprocessing.Pool(a.threads) as pool:
        pool.map(_pil_job, [(p, a.size) for p, _, _ in files], chunksize=8)
    pil_s = time.perf_counter() - t0

    got, got_labels = read_shards(out)
    assert len(got) == len(files), "dtrain wrote %d samples for %d files" % (len(got), len(files))
    ok = True
    print("%-10s %6s %12s %12s %12s %12s" % ("kind", "files", "max |diff|", "mean |diff|", "draft: max", "draft: mean"))
    by_kind = {}
    for label in range(a.classes):
        members = [f for f in files if f[1] == label]
        ref_full = np.stack([torchvision_like(p, a.size, False) for p, _, _ in members]).astype(np.int16)
        ref_draft = np.stack([torchvision_like(p, a.size, True) for p, _, _ in members]).astype(np.int16)
        mine = got[got_labels == label].astype(np.int16)
        assert len(mine) == len(members)
        # Closest draft-decoded reference for each of dtrain's samples; one-to-one.
        dist = np.abs(mine[:, None] - ref_draft[None]).reshape(len(mine), len(members), -1).mean(axis=2)
        match = dist.argmin(axis=1)
        if len(set(match.tolist())) != len(members):
            print("class %d: dtrain's samples do not match PIL's images one to one" % label)
            ok = False
        for i, j in enumerate(match):
            kind = members[j][2]
            full = np.abs(mine[i] - ref_full[j])
            draft = np.abs(mine[i] - ref_draft[j])
            by_kind.setdefault(kind, []).append((full.max(), full.mean(), draft.max(), draft.mean()))
    for kind in sorted(by_kind):
        v = np.array(by_kind[kind], np.float64)
        print("%-10s %6d %12d %12.3f %12d %12.3f" % (kind, len(v), v[:, 0].max(), v[:, 1].mean(), v[:, 2].max(),
                                                     v[:, 3].mean()))
        if v[:, 2].max() > 1:
            ok = False
    convert_s = max(dtrain_s - start_s, 1e-9)
    print("throughput: dtrain convert images %.0f images/s (%d threads, shards written; %.0f without its %.2f s "
          "start), PIL %.0f images/s (%d processes, no files written): %.2fx (%.2fx)"
          % (len(files) / dtrain_s, a.threads, len(files) / convert_s, start_s, len(files) / pil_s, a.threads,
             pil_s / dtrain_s, pil_s / convert_s))
    if not a.workdir:
        shutil.rmtree(work)
    print("PASS" if ok else "FAIL: a PNG or draft-decoded JPEG differs from PIL by more than 1")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
