"""Minimal supervisor pattern (tested): N=2 rank processes, ring over loopback, tensor-parallel
sharded_load, requests sent by the parent to EVERY rank over its stdin (one JSON line), each rank
tokenizes the same prompt and runs the same greedy generate_step loop; rank 0 streams tokens.
Between requests the ranks block on stdin (no collective pending -> no busy-spin).

Parent:  python minimal_group.py MODEL_DIR
Rank:    python minimal_group.py --rank   (env MLX_RANK, MLX_HOSTFILE)
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time

PY = sys.executable


def rank_main():
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init(strict=True, backend="ring")
    model, tok = sharded_load(os.environ["MODEL_DIR"], pipeline_group=None, tensor_group=group)
    print(json.dumps({"ev": "ready", "rank": group.rank()}), flush=True)
    for line in sys.stdin:  # blocking read: idle ranks use no CPU
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        prompt = mx.array(tok.encode(req["prompt"]))
        out = []
        for t, _ in generate_step(prompt, model, max_tokens=req["max_tokens"],
                                  sampler=lambda lp: mx.argmax(lp, axis=-1)):
            out.append(int(t))  # same token on every rank (logits are all_sum'ed)
        print(json.dumps({"ev": "result", "rank": group.rank(), "tokens": out}), flush=True)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def is_listening(port):
    want = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as f:
        return any(l.split()[1] == want and l.split()[3] == "0A" for l in f.readlines()[1:])


def pdeathsig():
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def parent_main(model_dir, n=2):
    ports = free_ports(n)
    hostfile = f"/tmp/dist-research/hosts_{os.getpid()}.json"
    with open(hostfile, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    procs = []
    t0 = time.time()
    try:
        for r in range(n):
            if r == n - 1:  # last rank connects first: start it once the others listen
                while not all(is_listening(p) for p in ports[:-1]):
                    if time.time() - t0 > 30:
                        raise TimeoutError("ranks did not start listening")
                    time.sleep(0.01)
            env = dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=hostfile, MODEL_DIR=model_dir)
            procs.append(subprocess.Popen([PY, __file__, "--rank"], env=env, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          preexec_fn=pdeathsig))
        for p in procs:  # real code: select() with a deadline, kill all on timeout
            assert json.loads(p.stdout.readline())["ev"] == "ready"
        print("group ready after", round(time.time() - t0, 2), "s")
        req = json.dumps({"prompt": "Once upon a time", "max_tokens": 16})
        for p in procs:
            p.stdin.write(req + "\n")
            p.stdin.flush()
        res = [json.loads(p.stdout.readline()) for p in procs]
        print("rank0 tokens", res[0]["tokens"], "ranks agree:", res[0]["tokens"] == res[1]["tokens"])
        for p in procs:
            p.stdin.write(json.dumps({"op": "quit"}) + "\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=30)
        print("exit codes", [p.returncode for p in procs])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.unlink(hostfile)


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank"]:
        rank_main()
    else:
        parent_main(sys.argv[1])
