#!/bin/sh
# Create MQTT credentials for one pansketch device (or aggregator) and a
# config skeleton for it. See deploy/OPERATIONS.md.
#
#   make-device-credentials.sh [options] DEVICE_ID
#   make-device-credentials.sh [options] --aggregator NAME
#
# Options:
#   -p FILE   mosquitto password file to add the account to
#             (default /etc/mosquitto/pansketch/passwd; created if missing)
#   -a FILE   ACL file (default /etc/mosquitto/pansketch/acl); only used for
#             --aggregator, devices are covered by the ACL's pattern lines
#   -o DIR    where to write the device's files (default ./pansketch-creds)
#   -H HOST   broker host name the device connects to (default: this host's name)
#   -P PORT   broker TLS port (default 8883)
#   -c FILE   CA certificate to ship to the device (default /etc/mosquitto/pansketch/ca.crt)
#   -s SALT   fleet salt (default: read from DIR/fleet-salt, created once)
#   --aggregator NAME   create an aggregator account and ACL block (reads releases, writes acks,
#             may not publish releases or status of its own); one account per aggregator
#
# Writes DIR/<id>/password (mode 600), DIR/<id>/ca.crt (and ca.der, the form
# the MicroPython firmware loads) and DIR/<id>/agent.toml (or host.toml for an
# aggregator). Copy that directory to /etc/pansketch/ on the device. The
# password file is kept root:mosquitto mode 640 (the broker reads it as the
# mosquitto user). A device id that is an aggregator account (a "user" block
# in the ACL) is refused, and so is an aggregator name that is already a
# device account. Reload mosquitto afterwards: systemctl reload mosquitto.
set -eu

PASSWD=/etc/mosquitto/pansketch/passwd
ACL=/etc/mosquitto/pansketch/acl
OUT=./pansketch-creds
HOST=$(hostname -f 2>/dev/null || hostname)
PORT=8883
CA=/etc/mosquitto/pansketch/ca.crt
SALT=
ROLE=device

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "make-device-credentials: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    -p) PASSWD=$2; shift 2 ;;
    -a) ACL=$2; shift 2 ;;
    -o) OUT=$2; shift 2 ;;
    -H) HOST=$2; shift 2 ;;
    -P) PORT=$2; shift 2 ;;
    -c) CA=$2; shift 2 ;;
    -s) SALT=$2; shift 2 ;;
    --aggregator) ROLE=aggregator; shift ;;
    -h|--help) usage 0 ;;
    -*) die "unknown option $1 (try --help)" ;;
    *) break ;;
  esac
done
[ $# -eq 1 ] || usage 2
ID=$1
# The same rule as pansketch.agent.params: letters, digits, '-', '_', '.'; at most 64.
case "$ID" in
  ''|*[!A-Za-z0-9._-]*) die "id '$ID' may only contain letters, digits, '-', '_' and '.'" ;;
esac
[ ${#ID} -le 64 ] || die "id '$ID' is longer than 64 characters"
command -v mosquitto_passwd >/dev/null 2>&1 || die "mosquitto_passwd not found (apt-get install mosquitto)"

# The ACL's pattern lines give every account the topics of a device named
# like it: a device may not share a name with an aggregator account.
is_aggregator=no
if [ -f "$ACL" ] && grep -qx "user $ID" "$ACL"; then is_aggregator=yes; fi
has_account=no
if [ -f "$PASSWD" ] && awk -F: -v id="$ID" '$1 == id { f = 1 } END { exit !f }' "$PASSWD"; then has_account=yes; fi
if [ "$ROLE" = device ] && [ "$is_aggregator" = yes ]; then
  die "'$ID' is an aggregator account in $ACL; choose another device id"
fi
if [ "$ROLE" = aggregator ] && [ "$has_account" = yes ] && [ "$is_aggregator" = no ]; then
  die "'$ID' is already a device account in $PASSWD; choose another aggregator name"
fi

umask 077
mkdir -p "$OUT/$ID"
if [ -z "$SALT" ]; then
  if [ ! -s "$OUT/fleet-salt" ]; then
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$OUT/fleet-salt"
  fi
  SALT=$(cat "$OUT/fleet-salt")
fi
PW=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s\n' "$PW" > "$OUT/$ID/password"
chmod 600 "$OUT/$ID/password"

if [ ! -f "$PASSWD" ]; then
  mkdir -p "$(dirname "$PASSWD")"
  : > "$PASSWD"
fi
mosquitto_passwd -b "$PASSWD" "$ID" "$PW"
# mosquitto reads the file after dropping to its own user: group mosquitto, 640
chmod 640 "$PASSWD"
if ! chgrp mosquitto "$PASSWD" 2>/dev/null; then
  echo "make-device-credentials: warning: could not chgrp mosquitto $PASSWD; the broker must be able to read it" >&2
fi
CAREF='tls = true                # verified against the system CA store; or tls_ca = "ca.crt"'
if [ -f "$CA" ]; then
  cp "$CA" "$OUT/$ID/ca.crt"
  CAREF='tls_ca = "ca.crt"'
  if command -v openssl >/dev/null 2>&1; then
    openssl x509 -in "$CA" -outform der -out "$OUT/$ID/ca.der"   # for the MicroPython firmware
  fi
fi

if [ "$ROLE" = aggregator ]; then
  if ! grep -qx "user $ID" "$ACL" 2>/dev/null; then
    # deny first: the pattern lines would let it write pansketch/$ID/release
    printf '\nuser %s\ntopic deny pansketch/%s/#\ntopic read pansketch/+/release\ntopic read pansketch/+/status\ntopic write pansketch/+/ack\n' "$ID" "$ID" >> "$ACL"
    chmod 644 "$ACL"   # not secret; the broker reads it as the mosquitto user
  fi
  cat > "$OUT/$ID/host.toml" <<EOF
# pansketch host config for aggregator '$ID' (reference: docs/HOST.md)
[broker]
host = "$HOST"
port = $PORT
$CAREF
username = "$ID"
password_file = "password"

[aggregator]
db = "/var/lib/pansketch/pansketch.db"
topic = "pansketch/+/release"
# Several aggregators sharing the load: each has its own account (run this
# script with --aggregator agg-2, ...) and the same shared_group. One account
# for several would not work: the broker forces client id = username, so they
# would keep disconnecting each other.
# shared_group = "aggregators"

[fleet]
salt = "$SALT"
EOF
  echo "aggregator '$ID': account added to $PASSWD, ACL block (read releases/status, write acks, no releases of its own) in $ACL"
  echo "files: $OUT/$ID/ (password, host.toml, ca.crt if found) -> /etc/pansketch/ on the aggregator host"
else
  cat > "$OUT/$ID/agent.toml" <<EOF
# pansketch-agent config for device '$ID' (reference: docs/AGENT.md)
[broker]
host = "$HOST"
port = $PORT
$CAREF
username = "$ID"
password_file = "password"

[device]
id = "$ID"
salt = "$SALT"

[sketch]
kind = "cs"
d = 4
w = 2048

[privacy]
mode = "window"
mechanism = "dgauss"
budget = "1/2"
window_s = 3600

[storage]
dir = "/var/lib/pansketch"

[source]
type = "stdin"
EOF
  echo "device '$ID': account added to $PASSWD (the ACL's pattern lines let it write pansketch/$ID/release and /status and read pansketch/$ID/ack only)"
  echo "files: $OUT/$ID/ (password, agent.toml, ca.crt if found) -> /etc/pansketch/ on the device; edit [source]"
fi
echo "then: systemctl reload mosquitto"
