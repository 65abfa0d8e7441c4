#!/usr/bin/python3
"""Knowledge distillation on Fashion-MNIST: a teacher (ResNet-20 by default) trained with the
reference recipe (examples/fashion_cnn.ini, 2 ranks, global batch 64), then the student
(SimpleCNN) trained with the same recipe alone and taught by the teacher (--teacher, at each
--distill-temperature/--distill-weight given), each at two seeds, all in one run on one machine.
Writes distill.csv and distill.md (the table, with the means over the seeds) into --out.

usage: benchmarks/compression/distill.py [--teacher-model resnet20] [--teacher-epochs 10]
           [--student-model simple_cnn] [--epochs 10] [--seeds 42 43] [--temperature 2]
           [--weight 0.5] [--out runs/distill] [--resume-teacher]
"""
import argparse
import csv
import os
import statistics

from runs import add_common_args, train, write_table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "distill")
    p.add_argument("--teacher-model", default="resnet20")
    p.add_argument("--teacher-epochs", type=int, default=10)
    p.add_argument("--student-model", default="simple_cnn")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    p.add_argument("--temperature", type=float, nargs="+", default=[2.0])
    p.add_argument("--weight", type=float, nargs="+", default=[0.5])
    p.add_argument("--resume-teacher", action="store_true",
                   help="continue an interrupted teacher from its last checkpoint in OUT/ckpt-teacher")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    resume = ["--resume", os.path.join(args.out, "ckpt-teacher")] if args.resume_teacher else []
    teacher = train(args, "teacher", ["--model", args.teacher_model] + resume, epochs=args.teacher_epochs)
    rows = [{"model": args.teacher_model, "teacher": "-", "T": "-", "weight": "-", "seed": 42,
             "test_accuracy": teacher["test_accuracy"], "samples_per_s": teacher["samples_per_s"]}]
    variants = [("alone", [])] + [(f"T{t:g}-w{w:g}", ["--teacher", os.path.join(args.out, "ckpt-teacher"),
                                                     "--distill-temperature", t, "--distill-weight", w])
                                  for t in args.temperature for w in args.weight]
    for name, options in variants:
        for seed in args.seeds:
            s = train(args, f"student-{name}-{seed}", ["--model", args.student_model, "--seed", seed] + options)
            rows.append({"model": args.student_model, "teacher": "-" if name == "alone" else args.teacher_model,
                         "T": options[3] if options else "-", "weight": options[5] if options else "-",
                         "seed": seed, "test_accuracy": s["test_accuracy"], "samples_per_s": s["samples_per_s"]})
    with open(os.path.join(args.out, "distill.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    lines = ["| model | teacher | T | weight | seed | test accuracy | samples/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['teacher']} | {r['T']} | {r['weight']} | {r['seed']} | "
              f"{100 * r['test_accuracy']:.2f} % | {r['samples_per_s']:.0f} |" for r in rows]
    alone = statistics.mean(r["test_accuracy"] for r in rows[1:] if r["teacher"] == "-")
    lines.append("")
    lines.append(f"mean over seeds {args.seeds}: {args.student_model} alone {100 * alone:.2f} %")
    for t in args.temperature:
        for wt in args.weight:
            m = statistics.mean(r["test_accuracy"] for r in rows if r["T"] == t and r["weight"] == wt)
            lines.append(f"- taught by {args.teacher_model} (T {t:g}, weight {wt:g}): {100 * m:.2f} % "
                         f"({100 * (m - alone):+.2f} points)")
    write_table(args.out, "distill.md", lines)


if __name__ == "__main__":
    main()
