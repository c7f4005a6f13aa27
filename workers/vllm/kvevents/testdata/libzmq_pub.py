"""A KV event publisher on libzmq, as vLLM's ZmqEventPublisher sends.

Usage: python3 libzmq_pub.py ENDPOINT [connect [heartbeats]]

Binds a PUB socket at ENDPOINT (tcp://127.0.0.1:0 for a free port) and
prints the endpoint it bound, or with "connect" connects it to ENDPOINT
(a subscriber that binds) and prints ENDPOINT, sending no heartbeats, as
vLLM's publisher does when its endpoint names a host, unless "heartbeats"
follows; then it publishes a batch every 20 ms until stdin
closes: multipart (topic b"", 8-byte big-endian sequence number, msgpack
payload), the payload an array-like EventBatch [ts, events, dp_rank?]
whose events are tagged arrays. What batch s holds is a function of s,
which the Go test computes again. Bound (or connecting with "heartbeats"),
the socket sends ZMTP heartbeats every 20 ms and drops a subscriber that
does not answer them within 300 ms.
"""
import sys
import threading
import time

import msgpack
import zmq


def batch(s):
    if s % 10 == 9:
        events = [["AllBlocksCleared"]]
    else:
        k = 600 if s % 7 == 3 else 1 + s % 40
        hashes = [s * 1000 + i for i in range(1, k + 1)]
        parent = [None, 0, s * 1000][s % 3]
        tokens = [(s + i) % 50000 for i in range(16 * k)]
        stored = ["BlockStored", hashes, parent, tokens, 16, None]
        if s % 4 != 0:  # older engines send no medium
            stored.append("GPU")
        events = [stored, ["BlockRemoved", [s * 1000 + 1], "GPU"]]
    b = [time.time(), events]
    if s % 2 == 1:
        b.append(1)
    return msgpack.packb(b)


def main():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    if sys.argv[2:3] == ["connect"]:
        if sys.argv[3:] == ["heartbeats"]:
            pub.setsockopt(zmq.HEARTBEAT_IVL, 20)
            pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
        pub.connect(sys.argv[1])
        print(sys.argv[1], flush=True)
    else:
        pub.setsockopt(zmq.HEARTBEAT_IVL, 20)
        pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
        pub.bind(sys.argv[1])
        print(pub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    s = 0
    while not done.is_set():
        pub.send_multipart([b"", s.to_bytes(8, "big"), batch(s)])
        s += 1
        time.sleep(0.02)
    pub.close()
    ctx.term()


if __name__ == "__main__":
    main()
