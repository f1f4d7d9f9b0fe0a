"""Relays TCP between two network namespaces through a Unix socket (a file both see), for
tests/bootstrap/sandbox: the sandbox has a network of its own (its loopback, its metadata
address, its firewall rules) and reaches the broker on the host's loopback only through this.

    python3 relay.py listen-unix SOCKET HOST PORT   # host side: SOCKET -> HOST:PORT
    python3 relay.py listen-tcp HOST PORT SOCKET    # sandbox side: HOST:PORT -> SOCKET
"""

import os
import socket
import sys
import threading


def pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listener, connect):
    while True:
        client, _ = listener.accept()
        try:
            upstream = connect()
        except OSError as e:
            sys.stderr.write(f"relay: cannot connect: {e}\n")
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


mode = sys.argv[1]
if mode == "listen-unix":
    path, host, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    serve(listener, lambda: socket.create_connection((host, port)))
elif mode == "listen-tcp":
    host, port, path = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)

    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    serve(listener, connect)
else:
    sys.exit(f"usage: {sys.argv[0]} listen-unix SOCKET HOST PORT | listen-tcp HOST PORT SOCKET")
