"""The EC2 API as it misbehaves, for bench/chaos: an HTTP proxy in front of LocalStack's EC2
endpoint (the brokers' AWS_ENDPOINT_URL_EC2) that forwards every request unchanged, except while
its control file says otherwise:
  ok         forward (also when the file is missing or unreadable)
  throttle   answer 503 with EC2's `RequestLimitExceeded` error document
  fail       answer 500 with EC2's `InternalError` (Unavailable) error document
It writes one line per request to its log: time, the EC2 action, what it did.

    python3 cloud_proxy.py PORT UPSTREAM_URL CONTROL_FILE LOG_FILE
"""

import http.client
import http.server
import sys
import time
import urllib.parse
import uuid

PORT, UPSTREAM, CONTROL, LOG = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
up = urllib.parse.urlsplit(UPSTREAM)
ERRORS = {
    "throttle": (503, "RequestLimitExceeded", "Request limit exceeded."),
    "fail": (500, "InternalError", "An internal error has occurred."),
}


def mode():
    try:
        with open(CONTROL) as f:
            return f.read().strip() or "ok"
    except OSError:
        return "ok"


class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _relay(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        action = urllib.parse.parse_qs(body.decode("utf-8", "replace")).get("Action", ["?"])[0]
        what = mode()
        with open(LOG, "a") as log:
            log.write(f"{time.time():.3f} {action} {what}\n")
        if what in ERRORS:
            status, code, message = ERRORS[what]
            doc = (
                '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
                f"<Code>{code}</Code><Message>{message}</Message></Error></Errors>"
                f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/xml")
            self.send_header("Content-Length", str(len(doc)))
            self.end_headers()
            self.wfile.write(doc)
            return
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_POST = do_GET = _relay

    def log_message(self, fmt, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Proxy).serve_forever()
