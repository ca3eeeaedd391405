# SPDX-License-Identifier: MIT
# A host as Python's ctypes bindings are (llama-cpp-python): libllama loaded with ctypes.CDLL
# (dlopen, RTLD_LOCAL) and every function, llama_decode too, called through a pointer from dlsym,
# past the preload. Loads MODEL, then ROUNDS times: generates greedily, then idles IDLE_MS. One
# JSON line per round: the tokens, VmLck while generating and after the idle.
# "threads-cache" (an 8th argument): as a Python server with a thread per request does, each round
# generates on a new thread, and after each round the main thread adds 20 MiB of small objects to
# a cache it keeps (the heap grows between decodes; none of it is the engine's).
# Usage: python3 ctypes_host.py LIBLLAMA MODEL ROUNDS IDLE_MS SIZEOF_MODEL_PARAMS SIZEOF_CONTEXT_PARAMS SIZEOF_BATCH [threads-cache]
import ctypes as C
import json
import re
import sys
import threading
import time

lib_path, model_path, rounds, idle_ms, model_params_size, context_params_size, batch_size = sys.argv[1:8]
threads_and_cache = len(sys.argv) > 8 and sys.argv[8] == "threads-cache"


def opaque(size):
    # A struct passed by value, as bytes of its size and alignment (every one here is over 16
    # bytes, so the ABI passes it in memory: only its size and alignment matter).
    class Opaque(C.Structure):
        _fields_ = [("bytes", C.c_uint64 * (int(size) // 8))]
    return Opaque


ModelParams, ContextParams, Batch = opaque(model_params_size), opaque(context_params_size), opaque(batch_size)
llama = C.CDLL(lib_path)
p = C.c_void_p
for name, res, args in [
        ("llama_backend_init", None, []),
        ("llama_model_default_params", ModelParams, []),
        ("llama_context_default_params", ContextParams, []),
        ("llama_model_load_from_file", p, [C.c_char_p, ModelParams]),
        ("llama_init_from_model", p, [p, ContextParams]),
        ("llama_set_n_threads", None, [p, C.c_int32, C.c_int32]),
        ("llama_model_get_vocab", p, [p]),
        ("llama_vocab_n_tokens", C.c_int32, [p]),
        ("llama_tokenize", C.c_int32, [p, C.c_char_p, C.c_int32, C.POINTER(C.c_int32), C.c_int32, C.c_bool, C.c_bool]),
        ("llama_batch_get_one", Batch, [C.POINTER(C.c_int32), C.c_int32]),
        ("llama_decode", C.c_int32, [p, Batch]),
        ("llama_get_logits_ith", C.POINTER(C.c_float), [p, C.c_int32]),
        ("llama_memory_clear", None, [p, C.c_bool]),
        ("llama_get_memory", p, [p]),
        ("llama_free", None, [p]),
        ("llama_model_free", None, [p])]:
    f = getattr(llama, name)
    f.restype, f.argtypes = res, args


def vmlck_kb():
    with open("/proc/self/status") as s:
        return int(re.search(r"VmLck:\s+(\d+)", s.read()).group(1))


llama.llama_backend_init()
model = llama.llama_model_load_from_file(model_path.encode(), llama.llama_model_default_params())
assert model, "model load failed"
ctx = llama.llama_init_from_model(model, llama.llama_context_default_params())
assert ctx, "context failed"
llama.llama_set_n_threads(ctx, 1, 1)
vocab = llama.llama_model_get_vocab(model)
n_vocab = llama.llama_vocab_n_tokens(vocab)
prompt = b"Once upon a time"
cache = []


def generate(rnd):
    toks = (C.c_int32 * 64)()
    n = llama.llama_tokenize(vocab, prompt, len(prompt), toks, 64, True, False)
    assert n > 0
    out, locked = [], 0
    batch_tokens, count = toks, n
    for _ in range(6):
        assert llama.llama_decode(ctx, llama.llama_batch_get_one(batch_tokens, count)) == 0
        logits = llama.llama_get_logits_ith(ctx, -1)
        best = max(range(n_vocab), key=lambda i: logits[i])
        out.append(best)
        locked = max(locked, vmlck_kb())
        batch_tokens, count = (C.c_int32 * 1)(best), 1
    llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
    result[rnd] = (out, locked)


result = {}
for rnd in range(int(rounds)):
    if threads_and_cache:
        t = threading.Thread(target=generate, args=(rnd,))
        t.start()
        t.join()
        cache.extend(bytes([rnd % 251]) * 10240 for _ in range(2048))  # 20 MiB in 10 KiB objects
    else:
        generate(rnd)
    out, locked = result[rnd]
    time.sleep(int(idle_ms) / 1000)
    print(json.dumps({"round": rnd, "tokens": out, "locked_while_generating_kb": locked,
                      "locked_after_idle_kb": vmlck_kb()}), flush=True)
llama.llama_free(ctx)
llama.llama_model_free(model)
