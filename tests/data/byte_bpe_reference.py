#!/usr/bin/python3
"""An independent GPT-2 byte-level BPE, written from the published algorithm, to check dtrain's.

  byte_bpe_reference.py learn TEXT MERGES DIR   learns MERGES merges on TEXT (UTF-8), writes
                                                DIR/vocab.json and DIR/merges.txt as GPT-2 ships them
  byte_bpe_reference.py encode DIR TEXT IDS     encodes TEXT with DIR's files, writes the ids to IDS

Pre-tokens come from GPT-2's pattern under Python's `regex` module (python3-regex), not PCRE2.
"""
import json
import sys
from collections import Counter, defaultdict

import regex

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def stand_ins():
    """byte -> the printable character GPT-2 writes for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE = stand_ins()


def pre_tokens(text):
    """Each pre-token as its string of stand-in characters."""
    return ["".join(BYTE[b] for b in piece.encode("utf-8")) for piece in PATTERN.findall(text)]


def learn(text, merges):
    words = Counter(pre_tokens(text))
    seqs = [list(w) for w in words]
    counts = [words[w] for w in words]
    pairs = Counter()
    where = defaultdict(set)
    for i, s in enumerate(seqs):
        for a, b in zip(s, s[1:]):
            pairs[(a, b)] += counts[i]
            where[(a, b)].add(i)
    learned = []
    while len(learned) < merges and pairs:
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        if pairs[best] <= 1:
            break
        learned.append(best)
        for i in list(where[best]):
            s = seqs[i]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] -= counts[i]
                if pairs[(a, b)] <= 0:
                    del pairs[(a, b)]
            seqs[i] = s = apply(s, best)
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += counts[i]
                where[(a, b)].add(i)
        where.pop(best, None)
    return learned


def apply(symbols, pair):
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def encode(text, vocab, ranks):
    ids = []
    for word in pre_tokens(text):
        symbols = list(word)
        while len(symbols) > 1:
            ranked = [(ranks[p], p) for p in zip(symbols, symbols[1:]) if p in ranks]
            if not ranked:
                break
            symbols = apply(symbols, min(ranked)[1])
        ids.extend(vocab[s] for s in symbols)
    return ids


def main():
    if sys.argv[1] == "learn":
        text = open(sys.argv[2], encoding="utf-8", newline="").read()
        learned = learn(text, int(sys.argv[3]))
        pieces = [BYTE[b] for b in range(256)] + [a + b for a, b in learned] + ["<|endoftext|>"]
        vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
        with open(sys.argv[4] + "/vocab.json", "w", encoding="utf-8") as f:
            json.dump(vocab, f)  # ASCII with \u escapes, as GPT-2's own file
        with open(sys.argv[4] + "/merges.txt", "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in learned))
    elif sys.argv[1] == "encode":
        vocab = json.load(open(sys.argv[2] + "/vocab.json", encoding="utf-8"))
        lines = open(sys.argv[2] + "/merges.txt", encoding="utf-8").read().split("\n")[1:]
        ranks = {tuple(line.split(" ")): r for r, line in enumerate(l for l in lines if l)}
        text = open(sys.argv[3], encoding="utf-8", newline="").read()
        with open(sys.argv[4], "w") as f:
            f.write(" ".join(map(str, encode(text, vocab, ranks))))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
