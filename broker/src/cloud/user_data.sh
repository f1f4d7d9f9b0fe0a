#!/bin/bash
# Proteus agent bootstrap (EC2 user data). Filled in by the broker at launch:
#   {{BROKER_URL}}  the broker's URL as agents reach it
#   {{TOKEN}}       this instance's one-time bootstrap token (`pb_…`): good for the downloads
#                   below and for one exchange, at the agent's first contact, for the agent
#                   token (valid only for this instance and its job), which the agent then
#                   writes over /etc/proteus/agent.token. User data stays readable for the
#                   instance's life (ec2:DescribeInstanceAttribute); the token in it is dead
#                   once the agent has started, and a second exchange is refused and recorded.
#   {{CA_PEM}}      the CA to trust for the broker's HTTPS (`serve --tls-ca`), or nothing for
#                   the system roots
set -euo pipefail
BROKER_URL='{{BROKER_URL}}'
install -d -m 0700 /etc/proteus
install -d -m 0755 /var/lib/proteus/data
# Command jobs' programs run as this unprivileged user, not as the root agent: they cannot read
# the agent's memory, environment or /etc/proteus. Instance metadata is closed to it, so it
# cannot read this user data (and the bootstrap token in it) either.
id -u proteus-job >/dev/null 2>&1 || useradd --system --user-group --no-create-home \
    --home-dir /nonexistent --shell /usr/sbin/nologin proteus-job
JOB_UID=$(id -u proteus-job)
if command -v iptables >/dev/null; then
    iptables -C OUTPUT -d 169.254.169.254 -m owner --uid-owner "${JOB_UID}" -j REJECT 2>/dev/null \
        || iptables -I OUTPUT -d 169.254.169.254 -m owner --uid-owner "${JOB_UID}" -j REJECT
elif command -v nft >/dev/null; then
    nft add table inet proteus
    nft add chain inet proteus output '{ type filter hook output priority 0; }'
    nft add rule inet proteus output ip daddr 169.254.169.254 meta skuid "${JOB_UID}" reject
else
    echo "proteus bootstrap: neither iptables nor nft: cannot close instance metadata to programs" >&2
    exit 1
fi
install -d -m 0711 /var/lib/proteus/scratch
umask 077
# The token in a root-only file, not in the agent's environment (which /proc shows); the agent
# replaces it with its agent token.
printf '%s\n' '{{TOKEN}}' > /etc/proteus/agent.token
cat > /etc/proteus/agent.env <<ENV
PROTEUS_BROKER_URL=${BROKER_URL}
PROTEUS_AGENT_TOKEN_FILE=/etc/proteus/agent.token
PROTEUS_AGENT_DATA_DIR=/var/lib/proteus/data
PROTEUS_AGENT_LISTEN=0.0.0.0:7070
PROTEUS_AGENT_RUN_AS=proteus-job
PROTEUS_AGENT_SCRATCH_DIR=/var/lib/proteus/scratch
ENV
CA_PEM=$(cat <<'PROTEUS_CA_PEM'
{{CA_PEM}}
PROTEUS_CA_PEM
)
CURL_TLS=()
if [ -n "${CA_PEM}" ]; then
    printf '%s\n' "${CA_PEM}" > /etc/proteus/broker-ca.pem
    chmod 0644 /etc/proteus/broker-ca.pem
    echo "PROTEUS_CA_FILE=/etc/proteus/broker-ca.pem" >> /etc/proteus/agent.env
    CURL_TLS=(--cacert /etc/proteus/broker-ca.pem)
fi
fetch() { # fetch PATH DEST: from the broker, authenticated by the bootstrap token, with retries
    for attempt in $(seq 1 30); do
        if curl -fsS "${CURL_TLS[@]}" -H "Authorization: Bearer {{TOKEN}}" "${BROKER_URL}$1" -o "$2.part"; then
            mv "$2.part" "$2"
            return 0
        fi
        sleep 5
    done
    echo "proteus bootstrap: cannot fetch $1 from ${BROKER_URL}" >&2
    return 1
}
fetch /v1/downloads/proteus-agent /usr/local/bin/proteus-agent
chmod 0755 /usr/local/bin/proteus-agent
umask 022
for f in mnist-train-1of2.csv.gz mnist-train-2of2.csv.gz mnist-test.csv.gz digits-8x8.csv.gz movietweetings-100k.csv.gz; do
    fetch "/v1/downloads/data/$f" "/var/lib/proteus/data/$f" || true
done
cat > /etc/systemd/system/proteus-agent.service <<'UNIT'
[Unit]
Description=Proteus training agent
After=network-online.target
Wants=network-online.target

[Service]
EnvironmentFile=/etc/proteus/agent.env
# The agent advertises the instance's local-ipv4 (from instance metadata) to its peers.
ExecStart=/usr/local/bin/proteus-agent
Restart=on-failure
RestartSec=2
# Interruption notices give two minutes; the agent hands over and exits well within them. When
# the machine shuts down under a running program (the backstop of a graceful stop), the agent
# gives it the job's grace (at most 600 s) and uploads its checkpoint: systemd waits that long.
TimeoutStopSec=660

[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now proteus-agent.service
