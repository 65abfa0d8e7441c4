# Shared by the emulated cluster's scripts (sourced, not run).
EMU_PREFIX=${DTRAIN_EMU_PREFIX:-emu}
EMU_SUBNET=${DTRAIN_EMU_SUBNET:-10.213.7}
EMU_SWITCH=${EMU_PREFIX}-switch

emu_say() { echo "emulate: $*" >&2; }
emu_node_names() { local i out=(); for ((i = 1; i <= $1; ++i)); do out+=("$EMU_PREFIX$i"); done; echo "${out[*]}"; }

# emu_can_run: root, iproute2, tc and util-linux's nsenter/unshare, and a network namespace we may
# create (some containers forbid it). Says why not.
emu_can_run() {
  if [[ $(id -u) -ne 0 ]]; then emu_say "needs root (network namespaces)"; return 1; fi
  local b
  for b in ip tc nsenter unshare setsid; do
    command -v "$b" >/dev/null 2>&1 || { emu_say "$b not found (apt-get install iproute2 util-linux)"; return 1; }
  done
  local probe="${EMU_PREFIX}-probe$$"
  if ! ip netns add "$probe" 2>/dev/null; then emu_say "cannot create a network namespace here"; return 1; fi
  ip netns del "$probe"
}

# emu_node_dir DIR NODE, emu_node_pid DIR NODE: a node's folder and its holder process.
emu_node_dir() { echo "$1/nodes/$2"; }
emu_node_pid() { cat "$1/nodes/$2/pid" 2>/dev/null; }

# emu_alive DIR: every node's holder process is running.
emu_alive() {
  local n pid
  for n in $(cat "$1/node-names" 2>/dev/null || true); do
    pid=$(emu_node_pid "$1" "$n") && kill -0 "$pid" 2>/dev/null || return 1
  done
  [[ -s "$1/node-names" ]]
}

# emu_rate_args RATE: tc tbf arguments for RATE (e.g. 1gbit), with a burst of DTRAIN_EMU_BURST_MS
# (whole ms, default 10) of traffic at the rate, at least 32 KiB. Smaller bursts cost TCP a third of
# the link (1 ms: 0.088 GB/s of a 1 Gbit/s link's 0.125); benchmarks/scaling models the bucket.
emu_rate_args() {
  local bits
  bits=$(awk -v r="$1" 'BEGIN { n = r + 0; u = tolower(r); sub(/^[0-9.]+/, "", u);
    m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : (u == "bit" || u == "") ? 1 : -1;
    if (m < 0 || n <= 0) exit 1; printf "%.0f", n * m }') || { emu_say "bad link rate '$1' (e.g. 100mbit, 1gbit, 10gbit)"; return 2; }
  local burst=$((bits / 8 * ${DTRAIN_EMU_BURST_MS:-10} / 1000))
  ((burst < 32768)) && burst=32768
  echo "rate $1 burst $burst latency 100ms"
}

# emu_set_rate NODE RATE|none: limits both directions of NODE's link.
emu_set_rate() {
  local node=$1 rate=$2 args
  if [[ "$rate" == none || -z "$rate" ]]; then
    tc -n "$node" qdisc del dev eth0 root 2>/dev/null || true
    tc -n "$EMU_SWITCH" qdisc del dev "$node" root 2>/dev/null || true
    return 0
  fi
  args=$(emu_rate_args "$rate") || return 2
  # shellcheck disable=SC2086
  tc -n "$node" qdisc replace dev eth0 root tbf $args
  # shellcheck disable=SC2086
  tc -n "$EMU_SWITCH" qdisc replace dev "$node" root tbf $args
}

# emu_make_network DIR N RATE: the switch namespace with its bridge, and N node namespaces, each
# linked to the bridge by a veth pair (eth0 in the node, NODE in the switch).
emu_make_network() {
  local dir=$1 n=$2 rate=$3 i node
  ip netns add "$EMU_SWITCH"
  ip -n "$EMU_SWITCH" link add br0 type bridge
  ip -n "$EMU_SWITCH" link set br0 up
  : >"$dir/hosts"
  printf '127.0.0.1 localhost\n' >>"$dir/hosts"
  for ((i = 1; i <= n; ++i)); do
    node=$EMU_PREFIX$i
    ip netns add "$node"
    ip -n "$node" link add eth0 type veth peer name "$node" netns "$EMU_SWITCH"
    ip -n "$EMU_SWITCH" link set "$node" master br0 up
    ip -n "$node" addr add "$EMU_SUBNET.$i/24" dev eth0
    ip -n "$node" link set eth0 up
    ip -n "$node" link set lo up
    [[ -n "$rate" ]] && emu_set_rate "$node" "$rate"
    printf '%s %s\n' "$EMU_SUBNET.$i" "$node" >>"$dir/hosts"
  done
  emu_node_names "$n" | tr ' ' '\n' >"$dir/node-names"
}

# emu_start_node DIR I: node I's holder process, in its network namespace and in new UTS and mount
# namespaces where its hostname is set, and its own /var/tmp, the cluster's /etc/hosts and Open MPI
# site configuration are mounted.
emu_start_node() {
  local dir=$1 node=$EMU_PREFIX$2 nd
  nd=$(emu_node_dir "$dir" "$node")
  mkdir -p "$nd/var-tmp"
  chmod 1777 "$nd/var-tmp"
  local site=true conf=/etc/openmpi/openmpi-mca-params.conf
  [[ -f $conf ]] && site="mount --bind '$dir/openmpi-mca-params.conf' $conf"
  setsid nsenter --net="/var/run/netns/$node" unshare --uts --mount --propagation private \
    sh -c "hostname $node && mount --bind '$nd/var-tmp' /var/tmp && mount --bind '$dir/hosts' /etc/hosts && $site && exec sleep infinity" \
    </dev/null >"$nd/holder.log" 2>&1 &
  echo $! >"$nd/pid"
  disown $!
  local t
  for ((t = 0; t < 50; ++t)); do
    [[ "$(nsenter -t "$!" --uts hostname 2>/dev/null)" == "$node" ]] && return 0
    sleep 0.1
  done
  emu_say "node $node did not start: $(cat "$nd/holder.log")"
  return 1
}

# emu_write_site_config DIR: the nodes' Open MPI site configuration (what a cluster's admins put
# in /etc/openmpi): launch through on.sh, TCP between nodes on the cluster's subnet only.
emu_write_site_config() {
  local dir=$1 here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  {
    grep -v -E '^[[:space:]]*(btl|plm_rsh_agent|btl_tcp_if_include|oob_tcp_if_include)[[:space:]]*=' \
      /etc/openmpi/openmpi-mca-params.conf 2>/dev/null || true
    echo "# emulated cluster ($dir)"
    echo "plm_rsh_agent = $here/on.sh"
    echo "btl = tcp,self,vader"
    echo "btl_tcp_if_include = $EMU_SUBNET.0/24"
    echo "oob_tcp_if_include = $EMU_SUBNET.0/24"
  } >"$dir/openmpi-mca-params.conf"
}

# emu_write_env DIR N: DIR/env.sh for the scripts and users of the cluster.
emu_write_env() {
  cat >"$1/env.sh" <<ENV
export DTRAIN_EMU_DIR=$1
export DTRAIN_EMU_NODES="$(emu_node_names "$2")"
export DTRAIN_EMU_SUBNET=$EMU_SUBNET
ENV
}
