#!/bin/sh
# pansketch on a three-node RabbitMQ cluster: accounts, permissions, policy, checks.
# See deploy/OPERATIONS.md section 7. Run as root on any node of the cluster.
#
#   setup.sh join NODE           this node joins NODE's cluster (stop_app, join_cluster, start_app)
#   setup.sh check               every node in the MQTT client-id tracker (Ra cluster mqtt_node); a node
#                                left out is restarted (stop_app / start_app), else its MQTT connects hang
#   setup.sh policy              mirror device sessions (^mqtt-subscription-) on every node
#   setup.sh aggregator NAME     an aggregator account: consumes pansketch.* queues, publishes acks
#   setup.sh device ID           a device account: publishes only its own release/status, reads its own acks
#   setup.sh declare HOST_TOML   declare and bind the release queue (before any device publishes)
#
# Accounts get a random password written to $OUT/<name>/password (mode 600; OUT=./pansketch-creds).
# RABBITMQCTL (default rabbitmqctl) and PREFIX (default pansketch) may be set in the environment;
# tests/test_rabbitmq_cluster.py runs it with a RABBITMQCTL that prints its arguments and compares them
# with the test cluster's definitions.
set -eu

CTL=${RABBITMQCTL:-rabbitmqctl}
PREFIX=${PREFIX:-pansketch}
OUT=${OUT:-./pansketch-creds}
PY=${PYTHON:-python3}

die() { echo "setup.sh: $*" >&2; exit 2; }
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

# Device ids: no '.', which the MQTT plugin would turn into a routing-key level separator
valid_id() { echo "$1" | grep -Eq '^[A-Za-z0-9_-]{1,64}$' || die "'$1': use 1-64 letters, digits, '_' or '-'"; }

password() {
  # $1 = name: reuse an existing password file (re-running keeps the account usable)
  d="$OUT/$1"
  mkdir -p "$d" && chmod 700 "$d"
  [ -s "$d/password" ] || (umask 077 && od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$d/password")
  cat "$d/password"
}

add_user() {
  # $1 = name; add the account or reset its password to the one on file
  pw=$(password "$1")
  $CTL add_user "$1" "$pw" >/dev/null 2>&1 || $CTL change_password "$1" "$pw" >/dev/null
}

[ $# -ge 1 ] || usage
case "$1" in
  join)
    [ $# -eq 2 ] || usage
    $CTL stop_app
    $CTL join_cluster "$2"
    $CTL start_app
    ;;
  check)
    for n in $($CTL eval 'rabbit_nodes:all_running().' | tr -d "[]'" | tr ',' ' '); do
      members=$($CTL -n "$n" eval 'ra:members({mqtt_node, node()}).' 2>&1 || true)
      ok=1
      for m in $($CTL eval 'rabbit_nodes:all_running().' | tr -d "[]'" | tr ',' ' '); do
        echo "$members" | grep -q "$m" || ok=0
      done
      if [ $ok = 1 ]; then
        echo "$n: MQTT client-id tracker complete"
      else
        echo "$n: left out of the MQTT client-id tracker ($members); restarting its app"
        $CTL -n "$n" stop_app && $CTL -n "$n" start_app
      fi
    done
    ;;
  policy)
    # Classic queue mirroring: deprecated, removed in RabbitMQ 4.0 (OPERATIONS.md: the upgrade path)
    $CTL set_policy -p / --apply-to queues mqtt-sessions '^mqtt-subscription-' \
      '{"ha-mode":"all","ha-sync-mode":"automatic"}'
    ;;
  aggregator)
    [ $# -eq 2 ] || usage
    valid_id "$2"
    add_user "$2"
    $CTL set_permissions -p / "$2" "^$PREFIX\\." "^(amq\\.topic|$PREFIX\\..*)\$" "^(amq\\.topic|$PREFIX\\..*)\$"
    $CTL set_topic_permissions -p / "$2" amq.topic "^$PREFIX\\.[^.]+\\.ack\$" "^$PREFIX\\.[^.]+\\.(release|status)\$"
    ;;
  device)
    [ $# -eq 2 ] || usage
    valid_id "$2"
    add_user "$2"
    q="^mqtt-subscription-$2qos[01]\$"
    $CTL set_permissions -p / "$2" "$q" "^amq\\.topic\$|$q" "^amq\\.topic\$|$q"
    $CTL set_topic_permissions -p / "$2" amq.topic "^$PREFIX\\.$2\\.(release|status)\$" "^$PREFIX\\.$2\\.ack\$"
    ;;
  declare)
    [ $# -eq 2 ] || usage
    $PY -m pansketch.host_tools.ingest.amqp --declare --config "$2"
    ;;
  *) usage ;;
esac
