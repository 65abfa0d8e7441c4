#!/usr/bin/python3
"""A dtrain checkpoint in PyTorch: `dtrain export` (safetensors, PyTorch names) loaded into the
PyTorch definition of the same model (torch_simple_cnn.py's SimpleCNN, an MLP or ResNet-20 as
nn.Sequential with dtrain's module paths, torchvision's resnet18, resnet50 and VisionTransformer
for examples/models/resnet18.json, resnet50.json and vit_mini.json,
torch_gpt.py's GPT, whose names the GPT-2 ones of the export are mapped onto, or torch_llama.py's
Llama under Hugging Face's names), then checked
  - on one batch: `dtrain eval --save-batch` writes the inputs the model took and dtrain's logits;
    PyTorch's logits on the same inputs must be within --tolerance (max abs difference, 1e-5), or,
    where PyTorch's own fp32 forward is further than that from the same model in float64, dtrain's
    no further from float64 than twice PyTorch's fp32 ones;
  - on the whole evaluation set: PyTorch's test accuracy (image models, the shards' own
    normalisation) or bits per byte on the validation stream (the GPT) against `dtrain eval`'s.
The safetensors files are read with json and numpy only. Run with /usr/bin/python3 (torch, numpy,
h5py from Debian).

  benchmarks/peers/check_export.py --dtrain build/dtrain --checkpoint runs/fashion_cnn --data data/fashion-mnist/test
  benchmarks/peers/check_export.py --dtrain build/dtrain --checkpoint runs/gpt_fortunes --data data/fortunes
Exit status 0 when both checks pass, 1 otherwise.
"""
import argparse
import collections
import copy
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DTYPES = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U8": "u1"}


def read_safetensors(np, path):
    """({name: array}, metadata) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=DTYPES[e["dtype"]]).reshape(e["shape"]).copy()
    return out, meta


def ints(meta, key):
    return [int(v) for v in meta[key].split(",")]


def image_model(torch, tensors, meta):
    nn = torch.nn
    if meta["model"] == "simple_cnn":
        import torch_simple_cnn
        c, h, _ = ints(meta, "input_shape")
        return torch_simple_cnn.model(torch, int(meta["classes"]), c, h)
    if meta["model"] == "mlp":  # Flatten, then (Linear, ReLU[, Dropout]) per hidden layer, then Linear
        linear = sorted(int(k.split(".")[0]) for k in tensors if k.endswith(".weight"))
        layers = collections.OrderedDict([("0", nn.Flatten())])
        for i, at in enumerate(linear):
            out_f, in_f = tensors[f"{at}.weight"].shape
            layers[str(at)] = nn.Linear(in_f, out_f)
            if i + 1 < len(linear):
                layers[str(at + 1)] = nn.ReLU()
                for gap in range(at + 2, linear[i + 1]):
                    layers[str(gap)] = nn.Dropout(0.0)
        return nn.Sequential(layers)
    if meta["model"] == "resnet20":
        return resnet20(torch, tensors)
    if "transformer_block" in meta.get("model_definition", ""):
        return vision_transformer(torch, meta)
    if meta["model"] in ("resnet18", "resnet50"):  # examples/models/resnet*.json, torchvision's names
        import torchvision
        model = getattr(torchvision.models, meta["model"])(num_classes=int(meta["classes"]))
        channels = ints(meta, "input_shape")[0]
        if channels != 3:  # the same stem for the data's channels
            model.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
        return model
    raise SystemExit(f"check_export: no PyTorch definition here for model {meta['model']}")


def vision_transformer(torch, meta):
    """torchvision's VisionTransformer of a model file's shape (examples/models/vit_mini.json: a patch
    convolution conv_proj, tokens, the position embedding, transformer blocks, encoder.ln, heads.head)."""
    import torchvision
    layers = json.loads(meta["model_definition"])["layers"]
    layers = layers.values() if isinstance(layers, dict) else layers  # an INI file's numbered sections
    proj = next(l for l in layers if l.get("name") == "conv_proj")
    blocks = [l for l in layers if l["type"] == "transformer_block"]
    channels, size, _ = ints(meta, "input_shape")
    hidden = int(proj["out"])
    model = torchvision.models.VisionTransformer(
        image_size=size, patch_size=int(proj["kernel"]), num_layers=len(blocks), num_heads=int(blocks[0]["heads"]),
        hidden_dim=hidden, mlp_dim=int(blocks[0].get("mlp", 4 * hidden)), num_classes=int(meta["classes"]))
    if channels != 3:
        model.conv_proj = torch.nn.Conv2d(channels, hidden, int(proj["kernel"]), int(proj["kernel"]))
    return model


def resnet20(torch, tensors):
    """dtrain's ResNet-20 as PyTorch modules with its module paths: conv, BN, ReLU, then one
    Sequential(Residual(body, shortcut), ReLU) per block (stride 2 where the channels grow, a 1x1
    conv + BN shortcut there), global average pool, Linear."""
    nn = torch.nn

    class Residual(nn.Module):
        def __init__(self, body, shortcut):
            super().__init__()
            self.body = body
            if shortcut is not None:
                self.shortcut = shortcut

        def forward(self, x):
            return self.body(x) + (self.shortcut(x) if hasattr(self, "shortcut") else x)

    first = tensors["0.weight"].shape
    layers = collections.OrderedDict([("0", nn.Conv2d(first[1], first[0], 3, 1, 1, bias=False)),
                                      ("1", nn.BatchNorm2d(first[0])), ("2", nn.ReLU())])
    blocks = sorted({int(k.split(".")[0]) for k in tensors if ".0.body.0." in k})
    for i in blocks:
        out_c, in_c = tensors[f"{i}.0.body.0.weight"].shape[:2]
        stride = 1 if in_c == out_c else 2
        body = nn.Sequential(nn.Conv2d(in_c, out_c, 3, stride, 1, bias=False), nn.BatchNorm2d(out_c), nn.ReLU(),
                             nn.Conv2d(out_c, out_c, 3, 1, 1, bias=False), nn.BatchNorm2d(out_c))
        shortcut = None
        if f"{i}.0.shortcut.0.weight" in tensors:
            shortcut = nn.Sequential(nn.Conv2d(in_c, out_c, 1, stride, 0, bias=False), nn.BatchNorm2d(out_c))
        layers[str(i)] = nn.Sequential(Residual(body, shortcut), nn.ReLU())
    head = max(int(k.split(".")[0]) for k in tensors)
    layers[str(head - 1)] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    classes, features = tensors[f"{head}.weight"].shape
    layers[str(head)] = nn.Linear(features, classes)
    return nn.Sequential(layers)


def gpt_model(torch, tensors, meta):
    """torch_gpt.Gpt with the export's GPT-2 tensors (Conv1D weights (in, out) back to Linear's)."""
    import torch_gpt
    vocab, context, layers, heads, width = ints(meta, "gpt")
    model = torch_gpt.Gpt(vocab, context, layers, heads, width)
    ours = {"transformer.wte.weight": "wte", "transformer.wpe.weight": "wpe",
            "transformer.ln_f.weight": "ln_f.weight", "transformer.ln_f.bias": "ln_f.bias"}
    part = {"ln_1": "ln1", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "ln_2": "ln2",
            "mlp.c_fc": "fc", "mlp.c_proj": "fc2"}
    state = {}
    for name, a in tensors.items():
        m = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)", name)
        if m:
            conv1d = m[2] not in ("ln_1", "ln_2") and m[3] == "weight"
            state[f"blocks.{m[1]}.{part[m[2]]}.{m[3]}"] = torch.from_numpy(a.T.copy() if conv1d else a)
        else:
            state[ours[name]] = torch.from_numpy(a)
    model.load_state_dict(state, strict=True)
    return model


def dtrain_eval(args, batch_file):
    cmd = [args.dtrain, "eval", "--checkpoint", args.checkpoint, "--data", args.data, "--batch-size",
           str(args.batch_size), "--threads", "1", "--save-batch", batch_file]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(HERE, "..", "..", "build", "dtrain"))
    ap.add_argument("--checkpoint", required=True, help="checkpoint file or directory")
    ap.add_argument("--data", required=True, help="image shards to evaluate on, or the GPT's text folder")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--tolerance", type=float, default=1e-5, help="largest abs logit difference on the batch")
    args = ap.parse_args()
    import numpy as np
    import torch
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="check_export-")
    weights, batch_file = os.path.join(work, "model.safetensors"), os.path.join(work, "batch.safetensors")
    subprocess.run([args.dtrain, "export", "--checkpoint", args.checkpoint, "--out", weights], check=True)
    tensors, meta = read_safetensors(np, weights)
    gpt = meta["model"] in ("gpt", "llama")
    if meta["model"] == "llama":  # Hugging Face's names: the peer's own
        import torch_llama
        model = torch_llama.from_export_metadata(meta)
    else:
        model = gpt_model(torch, tensors, meta) if gpt else image_model(torch, tensors, meta)
    if not gpt or meta["model"] == "llama":
        state = {k: torch.from_numpy(v) for k, v in tensors.items()}
        model.load_state_dict(state, strict=True)
    model.eval()
    report = dtrain_eval(args, batch_file)
    batch, _ = read_safetensors(np, batch_file)
    inputs = torch.from_numpy(batch["inputs"]).long() if gpt else torch.from_numpy(batch["inputs"])
    logits = torch.from_numpy(batch["logits"]).double().reshape(-1)
    with torch.no_grad():
        ours = model(inputs).double().reshape(-1)
        exact = copy.deepcopy(model).double()(inputs if gpt else inputs.double()).reshape(-1)
    diff = float((ours - logits).abs().max())
    # Where fp32 itself cannot hold the tolerance (a deep model's logits in the tens), dtrain passes
    # when it is no further from the float64 result than twice PyTorch's own fp32 forward is.
    own, theirs64 = float((ours - exact).abs().max()), float((logits - exact).abs().max())
    bound = max(args.tolerance, 2 * own)
    print(f"{meta['model']}: {len(tensors)} tensors loaded strictly; batch of {batch['inputs'].shape[0]}: "
          f"max |logit difference| {diff:.2e} (logits up to {float(logits.abs().max()):.2f}; tolerance "
          f"{args.tolerance:.0e}); from float64: dtrain {theirs64:.2e}, PyTorch fp32 {own:.2e}")
    ok = diff <= args.tolerance or theirs64 <= bound
    if gpt:
        theirs = float(re.search(r"fp32  loss ([0-9.]+) nats/token", report)[1])
        import h5py
        with h5py.File(os.path.join(args.data, "val.h5"), "r") as h:
            tokens = np.asarray(h["tokens"][...], dtype=np.int64)
        ctx = ints(meta, "gpt")[1]
        # dtrain eval's windows: consecutive, ctx + 1 tokens each overlapping by one, every one of them
        windows = (len(tokens) - 1) // ctx
        total, count = 0.0, 0
        with torch.no_grad():
            for b in range(0, windows, args.batch_size):
                n = min(args.batch_size, windows - b)
                span = tokens[b * ctx:(b + n) * ctx + 1]
                ids = torch.from_numpy(span[:-1].reshape(n, ctx))
                tgt = torch.from_numpy(span[1:].reshape(n, ctx))
                total += float(torch.nn.functional.cross_entropy(model(ids), tgt.reshape(-1), reduction="sum"))
                count += n * ctx
        mine = total / count
        print(f"validation: PyTorch {mine / math.log(2):.4f} bits/byte, dtrain {theirs / math.log(2):.4f}")
        ok &= abs(mine - theirs) <= 1e-4 * theirs
    else:
        import h5py
        import torch_simple_cnn
        x, y, _, _ = torch_simple_cnn.load_split(h5py, np, args.data)
        mean, std = [float(v) for v in meta["norm_mean"].split(",")], [float(v) for v in meta["norm_std"].split(",")]
        xs = torch.from_numpy(x).float() / 255.0
        m = torch.tensor(mean).reshape(1, -1, 1, 1) if xs.dim() == 4 else torch.tensor(mean[0])
        s = torch.tensor(std).reshape(1, -1, 1, 1) if xs.dim() == 4 else torch.tensor(std[0])
        with torch.no_grad():
            pred = torch.cat([model((xs[i:i + 256] - m) / s).argmax(1) for i in range(0, len(xs), 256)])
        mine = float((pred == torch.from_numpy(y)).float().mean())
        theirs = float(re.search(r"fp32  accuracy ([0-9.]+)%", report)[1]) / 100
        print(f"test accuracy: PyTorch {100 * mine:.2f} %, dtrain {100 * theirs:.2f} % ({len(y)} samples)")
        ok &= abs(mine - theirs) <= 1.5 / len(y)  # at most one sample decided differently
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
