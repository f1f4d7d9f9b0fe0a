#!/bin/bash
# Proteus agent bootstrap (EC2 user data). Filled in by the broker at launch:
#   {{BROKER_URL}}  the broker's URL as agents reach it
#   {{TOKEN}}       this instance's agent token (valid only for this instance and its job)
set -euo pipefail
BROKER_URL='{{BROKER_URL}}'
install -d -m 0700 /etc/proteus /var/lib/proteus/data
umask 077
cat > /etc/proteus/agent.env <<ENV
PROTEUS_BROKER_URL=${BROKER_URL}
PROTEUS_AGENT_TOKEN={{TOKEN}}
PROTEUS_AGENT_DATA_DIR=/var/lib/proteus/data
PROTEUS_AGENT_LISTEN=0.0.0.0:7070
ENV
# The agent binary and its data sets come from the broker, authenticated by the token.
for attempt in $(seq 1 30); do
    if curl -fsS -H "Authorization: Bearer {{TOKEN}}" "${BROKER_URL}/v1/downloads/proteus-agent" \
        -o /usr/local/bin/proteus-agent; then break; fi
    sleep 5
done
chmod 0755 /usr/local/bin/proteus-agent
cat > /etc/systemd/system/proteus-agent.service <<UNIT
[Unit]
Description=Proteus training agent
After=network-online.target
Wants=network-online.target

[Service]
EnvironmentFile=/etc/proteus/agent.env
ExecStart=/usr/local/bin/proteus-agent --advertise \$(hostname -I | cut -d' ' -f1):7070
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now proteus-agent.service
