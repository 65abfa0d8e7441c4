#!/usr/bin/env bash
# Multi-node tests on an emulated cluster (cluster/emulate/): 2 nodes, each a network namespace
# with its own address and hostname, started for the test and stopped at its end (even when it
# fails). Exit 77 (skipped) where the cluster cannot run (not root, no network namespaces);
# DTRAIN_REQUIRE_MULTINODE=1 makes that a failure.
#   multinode_test.sh mpirun    BIN DATA WORK  info --all-ranks; Fashion-MNIST on 2 nodes x 2 ranks
#                                              (cluster/mpirun/launch.sh, hostfile) against 4 ranks
#                                              on one node; cluster/pbs/train.pbs with a 2-host
#                                              PBS_NODEFILE
#   multinode_test.sh slurm     BIN WORK       train-multinode.sbatch -N 2 on a 2-node SLURM, then
#                                              preemption and requeue across the 2 nodes
#   multinode_test.sh node-loss BIN DATA WORK  a node's link goes down mid-run: the other node's
#                                              ranks exit within the comm timeout naming the node,
#                                              the job ends, the last checkpoint resumes
#   multinode_test.sh restart   BIN WORK       train-multinode.sbatch -N 2 on a 2-node SLURM; emu2 dies
#                                              mid-run (every process on it killed): the job relaunches
#                                              2 ranks on emu1 inside its allocation, resumes from its
#                                              newest checkpoint and finishes
#   multinode_test.sh node-local BIN WORK      a --checkpoint-dir on each node's own /var/tmp under
#                                              ZeRO-3 (2 nodes x 2 ranks): the first checkpoint fails
#                                              on every rank naming the folder and the other node's
#                                              ranks; the set it resumed from is intact
#   multinode_test.sh data      BIN DATA WORK  the training set read on 2 nodes x 2 ranks: the job-
#                                              wide store (chosen by auto past a node's budget)
#                                              and the node-shared cache train on the batches of
#                                              per-request reads; streaming reads each shard whole
set -euo pipefail
mode=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
# On a failure with SLURM up, its controller's last words too (a job's states and reasons).
fail() {
  echo "FAIL: $*"
  local log=$work/emu/slurm/log/slurmctld.log
  [[ -f $log ]] && { echo "== the last lines of $log"; tail -40 "$log"; }
  exit 1
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 DTRAIN_HOME=$root

# start_cluster ARGS...: the emulated cluster in $work/emu (a skip where it cannot run).
start_cluster() {
  local rc=0
  "$root/cluster/emulate/start.sh" "$@" "$work/emu" || rc=$?
  if [[ $rc -eq 77 ]]; then
    [[ "${DTRAIN_REQUIRE_MULTINODE:-0}" == "1" ]] && fail "the emulated cluster cannot run here"
    echo "SKIP: the emulated cluster cannot run here"
    exit 77
  fi
  [[ $rc -eq 0 ]] || fail "the emulated cluster did not start (status $rc)"
  trap '"$root/cluster/emulate/stop.sh" "$work/emu"' EXIT
  source "$work/emu/env.sh"
}
# on NODE CMD...: CMD with its words quoted, run on NODE in the work folder.
on() {
  local node=$1
  shift
  "$root/cluster/emulate/on.sh" "$node" "cd $(printf '%q' "$work") && $(printf '%q ' "$@")"
}
# losses METRICS: the step losses a metrics file holds, one per line.
losses() { grep '"step"' "$1" | grep -o '"loss": [0-9.e+-]*'; }
# summary_field METRICS NAME: a field of the run's summary line (rank 0's).
summary_field() { grep '"summary"' "$1" | grep -o "\"$2\": [0-9a-z\"]*" | head -1 | sed 's/.*: //; s/"//g'; }
# accuracy LOG: the last test accuracy the log reports, in percent.
accuracy() { grep -o 'test accuracy [0-9.]*%' "$1" | tail -1 | grep -o '[0-9.]*'; }

case "$mode" in
  mpirun)
    bin=$2 data=$3 work=$4
    rm -rf "$work" && mkdir -p "$work"
    start_cluster --nodes 2
    on emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none "$bin" info --all-ranks >"$work/info.txt" 2>&1 ||
      { cat "$work/info.txt"; fail "dtrain info across 2 nodes failed"; }
    cat "$work/info.txt"
    grep -q "dtrain: 4 ranks on 2 nodes" "$work/info.txt" || fail "info: not 4 ranks on 2 nodes"
    for r in "0 emu1 0 0/2" "1 emu1 0 1/2" "2 emu2 1 0/2" "3 emu2 1 1/2"; do
      grep -Eq "^ +$(echo "$r" | sed 's/ / +/g') " "$work/info.txt" || fail "info: no row 'rank host node local' = '$r'"
    done
    # One epoch of the reference recipe, 4 ranks of batch 64, on 2 nodes and on one node.
    args=(--config "$root/examples/fashion_cnn.ini" --data "$data/train" --test-data "$data/test" --epochs 1
      --threads 1 --progress off)
    printf 'emu1 slots=2\nemu2 slots=2\n' >"$work/hosts-two-nodes"
    printf 'emu1 slots=4\n' >"$work/hosts-one-node"
    for name in two-nodes one-node; do
      on emu1 env DTRAIN_HOSTFILE="$work/hosts-$name" DTRAIN_RUN_DIR="$work/$name" DTRAIN_BIN="$bin" \
        DTRAIN_MPIRUN_ARGS="--bind-to none --oversubscribe" "$root/cluster/mpirun/launch.sh" "${args[@]}" \
        >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; fail "$name: launch.sh failed"; }
      cat "$work/$name.log"
    done
    grep -q "dtrain: 4 ranks on 2 nodes" "$work/two-nodes.log" || fail "launch.sh: not 4 ranks on 2 nodes"
    grep -q "dtrain: 4 ranks on 1 node" "$work/one-node.log" || fail "launch.sh: not 4 ranks on 1 node"
    a2=$(accuracy "$work/two-nodes.log") a1=$(accuracy "$work/one-node.log")
    echo "test accuracy after 1 epoch: $a2% on 2 nodes x 2 ranks, $a1% on 1 node x 4 ranks"
    awk -v a="$a2" -v b="$a1" 'BEGIN { d = a - b; exit !(a > 80 && d <= 0.3 && d >= -0.3) }' ||
      fail "2 nodes reached $a2%, 1 node $a1%: expected > 80% and within 0.3 points"
    # PBS: one rank per line of PBS_NODEFILE, two hosts.
    printf 'emu1\nemu1\nemu2\nemu2\n' >"$work/pbs-nodefile"
    on emu1 env PBS_NODEFILE="$work/pbs-nodefile" PBS_O_WORKDIR="$work" PBS_JOBID=77.pbs PBS_JOBNAME=dtrain \
      PBS_ENVIRONMENT=PBS_BATCH DTRAIN_BIN="$bin" DTRAIN_ARGS="--synthetic --model mlp --steps 200 --threads 1 --progress off --log-every 100" \
      "$root/cluster/pbs/train.pbs" >"$work/pbs.log" 2>&1 || { cat "$work/pbs.log"; fail "train.pbs failed"; }
    cat "$work/pbs.log"
    grep -q "4 ranks on emu1,emu2" "$work/pbs.log" || fail "train.pbs: not 4 ranks from the 2-host PBS_NODEFILE"
    grep -q "dtrain: 4 ranks on 2 nodes" "$work/pbs.log" || fail "train.pbs: dtrain did not run on 2 nodes"
    # Trainer groups across the nodes: two groups of 2 ranks, each on a node of its own.
    on emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none "$bin" train --synthetic --model mlp --steps 100 \
      --threads 1 --progress off --trainers 2 --sweep lr=0.01,0.05 --sweep-dir "$work/sweep" >"$work/sweep.log" 2>&1 ||
      { cat "$work/sweep.log"; fail "trainer groups on 2 nodes failed"; }
    cat "$work/sweep.log"
    grep -q "trainer 0/2 (lr=0.01) on ranks 0-1, node 0" "$work/sweep.log" || fail "trainer groups: group 0 not on node 0"
    grep -q "trainer 1/2 (lr=0.05) on ranks 2-3, node 1" "$work/sweep.log" || fail "trainer groups: group 1 not on node 1"
    [[ $(grep -c '"status": "ok"' "$work/sweep/summary.json") -eq 2 ]] || fail "trainer groups: not 2 finished trainers"
    echo "PASS: 4 ranks on 2 emulated nodes (mpirun, launch.sh with a hostfile, train.pbs, 2 trainer groups); accuracy $a2% vs $a1%"
    ;;
  slurm)
    bin=$2 work=$3
    rm -rf "$work" && mkdir -p "$work"
    start_cluster --nodes 2 --slurm
    # SLURM's commands run on the first node, the login node of this cluster.
    for c in sbatch scontrol scancel; do eval "$c() { on emu1 $c \"\$@\"; }"; done
    source "$root/tests/cluster/slurm_lib.sh"
    export DTRAIN_BIN=$bin
    id=$(DTRAIN_GPUS_PER_TASK= sbatch --parsable -N 2 --ntasks-per-node=2 --gpus-per-task=0 --cpus-per-task=1 \
      --job-name=dtrain-multinode "$root/cluster/slurm/train-multinode.sbatch" --synthetic --model mlp \
      --steps 200 --threads 1 --progress off --log-every 100)
    state=$(wait_job "$id" 300)
    cat "$work/dtrain-$id.out"
    [[ "$state" == COMPLETED ]] || fail "train-multinode.sbatch: job $id ended $state"
    grep -q "dtrain: 4 ranks on 2 nodes; launcher SLURM" "$work/dtrain-$id.out" || fail "job $id: not 4 ranks on 2 nodes"
    grep -q '"summary": "run", "steps": 200,' "$work/runs/dtrain-multinode-$id/metrics.jsonl" || fail "job $id: no summary"
    echo "PASS (train-multinode.sbatch -N 2): job $id on 4 ranks, 2 nodes"
    SBATCH_SHAPE="-N 2 --ntasks-per-node=2" preempt_job dtrain 600 --synthetic --model mlp --threads 1 --progress off \
      --log-every 50
    for out in "$work"/dtrain-*.out; do grep -q "dtrain: 4 ranks on 2 nodes" "$out" || fail "$out: not on 2 nodes"; done
    ;;
  restart)
    bin=$2 work=$3
    rm -rf "$work" && mkdir -p "$work"
    start_cluster --nodes 2 --slurm
    for c in sbatch scontrol scancel sinfo; do eval "$c() { on emu1 $c \"\$@\"; }"; done
    source "$root/tests/cluster/slurm_lib.sh"
    export DTRAIN_BIN=$bin
    steps=1200
    id=$(DTRAIN_COMM_TIMEOUT=10 DTRAIN_GPUS_PER_TASK= sbatch --parsable -N 2 --ntasks-per-node=2 --gpus-per-task=0 \
      --cpus-per-task=1 --job-name=dtrain-restart "$root/cluster/slurm/train-multinode.sbatch" --synthetic --model mlp \
      --steps $steps --threads 1 --progress off --log-every 50 --checkpoint-every 100 --max-restarts 1)
    metrics="$work/runs/dtrain-restart-$id/metrics.jsonl"
    for ((i = 0; i < 1500; ++i)); do
      grep -Eq '"step": (2[5-9][0-9]|[3-9][0-9]{2}|[0-9]{4})' "$metrics" 2>/dev/null && break
      sleep 0.2
    done
    grep -q '"step": ' "$metrics" || { cat "$work/dtrain-$id.out"; fail "the job did not start training"; }
    # emu2 dies: every process on it (slurmd, its step daemon, its 2 ranks) but the namespaces' holder.
    holder=$(cat "$work/emu/nodes/emu2/pid")
    for p in $(ip netns pids emu2); do [[ $p == "$holder" ]] || kill -KILL "$p" 2>/dev/null || true; done
    died=$(grep -o '"step": [0-9]*' "$metrics" | tail -1 | grep -o '[0-9]*$')
    echo "emu2 killed after step $died was logged"
    state=$(wait_job "$id" 400)
    out="$work/dtrain-$id.out"
    cat "$out"
    [[ "$state" == COMPLETED ]] || fail "job $id ended $state"
    grep -Eq "restart 1/1 inside the allocation: lost emu2; 2 ranks on emu1 resume from step [0-9]+" "$out" ||
      fail "no restart on emu1 without emu2 in the log"
    resume=$(grep -o 'ranks on emu1 resume from step [0-9]*' "$out" | grep -o '[0-9]*$')
    ((resume > 0 && resume % 100 == 0)) || fail "resumed from step '$resume', not a checkpoint's"
    grep -Eq "resumed from .*ckpt-step0*$resume.h5 at step $resume( |\$)" "$out" || fail "dtrain did not resume at step $resume"
    grep -q "dtrain: 2 ranks on 1 node; launcher SLURM" "$out" || fail "the relaunch did not run 2 ranks on 1 node"
    grep -q '"event": "restart", "restart": 1, "lost_nodes": "emu2", "ranks": 2, "nodes": "emu1"' "$metrics" ||
      fail "no restart event in $metrics"
    grep -q "resume: 4 -> 2 rank(s), global batch 256 -> 128" "$out" || fail "the relaunch did not say how the world changed"
    # The epoch goes on at the sample it reached: step R of 256 samples is batch 2R of 128, so the
    # epoch of $steps batches of 128 ends at step $steps - R.
    grep -q "\"summary\": \"run\", \"steps\": $((steps - resume))," "$metrics" ||
      fail "the run did not finish its epoch at step $((steps - resume))"
    lost=$(grep -o '"steps_lost": [0-9]*' "$metrics" | grep -o '[0-9]*$')
    echo "PASS: emu2 lost after step $died; 2 ranks on emu1 resumed at step $resume inside job $id ($lost logged steps lost), finished the epoch at step $((steps - resume))"
    ;;
  node-loss)
    bin=$2 data=$3 work=$4
    rm -rf "$work" && mkdir -p "$work"
    start_cluster --nodes 2
    printf 'emu1 slots=2\nemu2 slots=2\n' >"$work/hosts"
    timeout=10 grace=10
    on emu1 env DTRAIN_HOSTFILE="$work/hosts" DTRAIN_RUN_DIR="$work/run" DTRAIN_BIN="$bin" DTRAIN_COMM_TIMEOUT=$timeout \
      DTRAIN_LAUNCHER_GRACE=$grace "$root/cluster/mpirun/launch.sh" --data "$data/train" --model simple_cnn \
      --epochs 3 --threads 1 --progress off --checkpoint-every 20 --log-every 20 >"$work/run.log" 2>&1 &
    job=$!
    for ((i = 0; i < 600; ++i)); do grep -q '^checkpoint ' "$work/run.log" 2>/dev/null && break; sleep 0.2; done
    grep -q '^checkpoint ' "$work/run.log" || { cat "$work/run.log"; fail "no checkpoint before the node loss"; }
    "$root/cluster/emulate/link.sh" emu2 down
    lost=$SECONDS
    # The surviving ranks time out after $timeout s, the launcher is ended $grace s after them.
    for ((i = 0; i < 4 * (timeout + grace + 15); ++i)); do kill -0 "$job" 2>/dev/null || break; sleep 0.25; done
    ended=$((SECONDS - lost))
    kill -0 "$job" 2>/dev/null && { kill -KILL "$job"; cat "$work/run.log"; fail "the job still runs $ended s after the node loss"; }
    rc=0; wait "$job" || rc=$?
    cat "$work/run.log"
    [[ $rc -ne 0 ]] || fail "the job ended with status 0 after losing a node"
    # One surviving rank reports (the first to abort; the other is usually killed before it prints,
    # docs/comm.md), and both surviving ranks leave their hang forensics.
    grep -Eq "fatal \(rank [01] on emu1\): comm timeout: .*ranks that did not arrive: 2, 3 on node emu2 \(all of its ranks\)" \
      "$work/run.log" || fail "no surviving rank named the lost node emu2 and its ranks 2, 3"
    grep -Eq "hang-rank<r>.txt written by world ranks (0, 1|1, 0)$" "$work/run.log" ||
      fail "the surviving ranks 0 and 1 did not both write their hang forensics"
    for r in 0 1; do [[ -s "$work/run/ckpt/hang-rank$r.txt" ]] || fail "no $work/run/ckpt/hang-rank$r.txt"; done
    echo "the job ended $ended s after emu2 was cut off (comm timeout $timeout s, launcher grace $grace s)"
    # The last checkpoint resumes (on the node that is left).
    last=$(ls "$work/run/ckpt"/ckpt-step*.h5 | tail -1)
    step=$(basename "$last" .h5 | sed 's/ckpt-step0*//')
    on emu1 mpirun --host emu1:2 -n 2 --bind-to none "$bin" train --data "$data/train" --model simple_cnn --threads 1 \
      --progress off --resume "$work/run/ckpt" --steps $((step + 10)) --checkpoint-dir "$work/resumed" >"$work/resume.log" 2>&1 ||
      { cat "$work/resume.log"; fail "the last checkpoint $last did not resume"; }
    grep -q "resumed from $last at step $step" "$work/resume.log" || { cat "$work/resume.log"; fail "did not resume at step $step"; }
    echo "PASS: node emu2 lost: ranks 2, 3 named with their node, the job ended in $ended s, resumed at step $step"
    ;;
  node-local)
    bin=$2 work=$3
    rm -rf "$work" && mkdir -p "$work"
    start_cluster --nodes 2
    common=(train --model mlp --hidden 32 --synthetic --batch-size 16 --threads 1 --progress off --zero 3
      --checkpoint-every 10)
    on emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none "$bin" "${common[@]}" --steps 10 \
      --checkpoint-dir "$work/shared" >"$work/shared.log" 2>&1 || { cat "$work/shared.log"; fail "the shared run failed"; }
    set10=$work/shared/ckpt-step000000010.h5
    [[ -f $set10 ]] || fail "no set of step 10 in the shared folder"
    sum=$(cat "$set10"* | md5sum)
    # Resumed into a folder on each node's own disk: rank 0 cannot see emu2's ranks' parts.
    local_dir=/var/tmp/dtrain-node-local-$$
    rc=0
    on emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none "$bin" "${common[@]}" --steps 20 --resume "$set10" \
      --checkpoint-dir "$local_dir" >"$work/local.log" 2>&1 || rc=$?
    cat "$work/local.log"
    [[ $rc -eq 2 ]] || fail "a node-local checkpoint folder: exit status $rc, expected 2"
    grep -q "checkpoint folder '$local_dir' is not one folder every rank shares: the writer of the set cannot see the parts of rank(s) 2, 3" \
      "$work/local.log" || fail "no message naming the folder and ranks 2, 3"
    on emu1 test ! -e "$local_dir/ckpt-step000000020.h5" || fail "a main file was written for the broken set"
    [[ "$(cat "$set10"* | md5sum)" == "$sum" ]] || fail "the set resumed from changed"
    on emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none "$bin" "${common[@]}" --steps 20 --resume "$set10" \
      --checkpoint-dir "$work/shared" >"$work/again.log" 2>&1 || { cat "$work/again.log"; fail "the set of step 10 did not resume"; }
    # Each node's own folder holds another run's set of the same name: a resume across both nodes takes
    # the sets rank 0 lists, and the ranks that read another run's set there say so.
    own=/var/tmp/dtrain-own-$$
    for node in emu1 emu2; do
      on "$node" mpirun --host "$node:2" -n 2 --bind-to none "$bin" train --model mlp --hidden 32 --synthetic \
        --batch-size 16 --threads 1 --progress off --steps 10 --checkpoint-dir "$own" >"$work/own-$node.log" 2>&1 ||
        { cat "$work/own-$node.log"; fail "the run on $node alone failed"; }
    done
    rc=0
    on emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none "$bin" train --model mlp --hidden 32 --synthetic \
      --batch-size 16 --threads 1 --progress off --steps 20 --resume "$own" >"$work/own.log" 2>&1 || rc=$?
    cat "$work/own.log"
    [[ $rc -eq 2 ]] || fail "a resume from two nodes' own folders: exit status $rc, expected 2"
    grep -q "rank 2 reads another set at '$own/ckpt-step000000010.h5' (run [0-9]*, step 10) than rank 0" "$work/own.log" ||
      fail "no message naming rank 2's other set"
    echo "a node-local folder failed the first checkpoint naming ranks 2, 3; the shared set of step 10 resumed"
    ;;
  data)
    bin=$2 data=$3 work=$4
    rm -rf "$work" && mkdir -p "$work"
    start_cluster --nodes 2
    # Fashion-MNIST's 47 MB in 6 shards of 7.8 MB: over a node's 40 MB, while each of the 4 ranks
    # holds at most 2 shards of the store within its 20 MB.
    common=(train --model mlp --hidden 32 --data "$data/train" --steps 30 --batch-size 16 --threads 1 --log-every 1
      --progress off)
    for run in store:auto:40 shared:auto:2048 rows:cache:0 stream:stream:64; do
      IFS=: read -r name mode mb <<<"$run"
      on emu1 mpirun --host emu1:2,emu2:2 -n 4 --bind-to none "$bin" "${common[@]}" --data-mode "$mode" \
        --data-cache-mb "$mb" --metrics "$work/$name.jsonl" >"$work/$name.log" 2>&1 ||
        { cat "$work/$name.log"; fail "--data-mode $mode --data-cache-mb $mb on 2 nodes failed"; }
      grep -q "dtrain: 4 ranks on 2 nodes" "$work/$name.log" || fail "$name: not 4 ranks on 2 nodes"
      grep -m1 -o "mode [a-z]* (.*), 4 ranks" "$work/$name.log"
    done
    grep -q "mode store (auto: " "$work/store.log" || fail "auto did not choose the store past a node's budget"
    grep -q "one copy shared by the node's 2 rank(s)" "$work/shared.log" || fail "auto did not share one copy per node"
    [[ $(losses "$work/rows.jsonl" | wc -l) -eq 30 ]] || fail "per-request reads: not 30 step losses"
    for name in store shared; do
      diff <(losses "$work/$name.jsonl") <(losses "$work/rows.jsonl") >/dev/null ||
        fail "$name: other losses than per-request reads (other batches)"
    done
    # Rank 0 holds shards 0 and 4 of the store, and reads 3 of 6 into its node's copy.
    [[ $(summary_field "$work/store.jsonl" data_whole_shard_reads) -eq 2 ]] || fail "store: rank 0 did not read its 2 shards"
    [[ $(summary_field "$work/shared.jsonl" data_whole_shard_reads) -eq 3 ]] || fail "shared: rank 0 did not read 3 shards"
    [[ $(summary_field "$work/stream.jsonl" data_mode) == stream ]] || fail "stream: not streamed"
    echo "store, node-shared cache and per-request reads trained the same 30 losses on 2 nodes x 2 ranks"
    ;;
  *) fail "mode must be mpirun, slurm, node-loss or data" ;;
esac
