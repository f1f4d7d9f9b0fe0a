"""A fake EC2 instance metadata service (IMDSv2) for tests/bootstrap/sandbox: what the agent
and the bootstrap script use of the real one, on the paths they use. `PUT /latest/api/token`
with `X-aws-ec2-metadata-token-ttl-seconds` gives a session token; every `GET` needs it
(`X-aws-ec2-metadata-token`, 401 without); `meta-data/instance-id`, `instance-type`,
`placement/availability-zone`, `local-ipv4` and `instance-life-cycle` answer; anything else,
`spot/instance-action` included (no interruption), is 404.

    python3 imds.py HOST PORT INSTANCE_ID INSTANCE_TYPE ZONE
"""

import http.server
import secrets
import sys

HOST, PORT, INSTANCE_ID, INSTANCE_TYPE, ZONE = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
TOKEN = secrets.token_hex(16)
META = {
    "instance-id": INSTANCE_ID,
    "instance-type": INSTANCE_TYPE,
    "placement/availability-zone": ZONE,
    "local-ipv4": "127.0.0.1",
    "instance-life-cycle": "on-demand",
}


class Imds(http.server.BaseHTTPRequestHandler):
    def _answer(self, status, body=b""):
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        if self.path != "/latest/api/token":
            return self._answer(404)
        if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(400)
        self._answer(200, TOKEN.encode())

    def do_GET(self):
        if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
            return self._answer(401)
        prefix = "/latest/meta-data/"
        value = META.get(self.path[len(prefix):]) if self.path.startswith(prefix) else None
        if value is None:
            return self._answer(404)
        self._answer(200, value.encode())

    def log_message(self, fmt, *args):
        sys.stderr.write("imds: " + (fmt % args) + "\n")


http.server.ThreadingHTTPServer((HOST, PORT), Imds).serve_forever()
