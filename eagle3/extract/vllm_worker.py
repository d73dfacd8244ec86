"""Worker extension mixed into each vLLM worker (``worker_extension_cls``). Driven by VLLMBackend via
collective_rpc; every reply is a small dict. Hidden states never leave the worker except into the
store, written by the owner (TP rank 0 of the last pipeline stage); other ranks only count tokens, so
the driver can check that every rank saw the same steps.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from eagle3.extract import vllm_compat as compat
from eagle3.extract.capture import COPY_CHUNK_BYTES, Capturer, unpack_announcement
from eagle3.targets.layers import hook_layer_index, validate_layer_ids

log = logging.getLogger("eagle3.worker")
# vLLM resolves the worker extension before it builds the model runner: the direct strategy's runner wrapper
# must be in place by then (it does nothing to engines started without DIRECT_KEY)
compat.install_direct_capture()


def configure_worker_logging(level: str | None = None) -> None:
    """Worker processes start with vLLM's logging only; give eagle3's logger a handler at the chosen level."""
    level = (level or os.environ.get("EAGLE3_LOG_LEVEL") or "WARNING").upper()
    logger = logging.getLogger("eagle3")
    logger.setLevel(level)
    if not any(getattr(h, "_eagle3", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s eagle3 worker pid={os.getpid()}: %(message)s")
        )
        handler._eagle3 = True
        logger.addHandler(handler)
        logger.propagate = False


class CaptureExtension:
    """Methods callable as ``llm.collective_rpc("eagle3_...")``."""

    def eagle3_setup(self, cfg: dict) -> dict:
        """Install the capture. cfg: layer_ids, strategy (hooks | aux), log_level."""
        configure_worker_logging(cfg.get("log_level"))
        par = compat.parallel_info()
        if par["pp_size"] > 1:
            raise RuntimeError("pipeline parallel capture is not supported; use tensor parallelism (--tp)")
        model = compat.get_model(self)
        layers = compat.decoder_layers(model)
        ids = validate_layer_ids(cfg["layer_ids"], len(layers))
        self._e3 = {
            "ids": ids,
            "strategy": cfg["strategy"],
            "owner": par["tp_rank"] == 0 and par["pp_last"],
            "capturer": None,
            "step": [],
            "last": None,
            "par": par,
        }
        runner = self.model_runner
        if cfg["strategy"] == "hooks":
            handles = []
            for k, layer_id in enumerate(ids):
                layer = layers[hook_layer_index(layer_id)]
                handles.append(layer.register_forward_hook(self._e3_hook(k == len(ids) - 1)))
            self._e3["handles"] = handles
        elif cfg["strategy"] == "direct":
            compat.attach_direct_capture(runner, ids, self._e3_on_step)
        else:
            compat.patch_drafter(runner, self._e3_on_step)
        hidden = int(getattr(model.config, "hidden_size", 0) or 0) if hasattr(model, "config") else 0
        log.info(
            "capture installed: strategy %s, layer ids %s, tp rank %d/%d, owner %s",
            cfg["strategy"],
            list(ids),
            par["tp_rank"],
            par["tp_size"],
            self._e3["owner"],
        )
        return {
            "rank": int(getattr(self, "rank", par["tp_rank"])),
            "tp_rank": par["tp_rank"],
            "tp_size": par["tp_size"],
            "owner": self._e3["owner"],
            "num_layers": len(layers),
            "layer_ids": list(ids),
            "hidden_size": hidden,
            "strategy": cfg["strategy"],
            "pid": os.getpid(),
        }

    def _e3_hook(self, last: bool):
        def hook(module, args, output):
            self._e3["step"].append(compat.layer_state(output))
            if last:
                step, self._e3["step"] = self._e3["step"], []
                self._e3_on_step(step)

        return hook

    def _e3_on_step(self, layers: list) -> None:
        """Runs inside vLLM's forward: it must never raise (an exception here kills the engine core);
        problems are recorded and reported by eagle3_collect."""
        self._e3["last"] = layers
        # extract --regenerate's row collector (every row of every request, prefill and decode), else the capture
        cap = self._e3.get("regen") or self._e3["capturer"]
        if cap is None:
            return
        try:
            layout = compat.step_layout(self.model_runner)
            if layout.req_ids:
                cap.on_step(layers, layout)
        except Exception as e:  # noqa: BLE001
            log.exception("capture failed in a forward step")
            cap.add_error(f"capture step: {type(e).__name__}: {e}")

    def eagle3_attach(self, on: bool) -> dict:
        """Direct only: hand each step's aux states to the capture (on), or to nothing (off: the engine as it runs
        without a capture, its model still returning them; the benchmark's plain_auxout)."""
        if self._e3["strategy"] != "direct":
            raise RuntimeError(f"only the direct capture detaches (this engine's is {self._e3['strategy']})")
        self.model_runner._eagle3_direct = self._e3_on_step if on else None
        return {"rank": self._e3["par"]["tp_rank"], "attached": bool(on)}

    def eagle3_open(self, cfg: dict) -> dict:
        """Start a session. cfg: mode (store | host | count), hidden_size, dtype, slots, copy_chunk_bytes,
        gil_sampler, and for store: root, spec, start_index, shard_tokens, fsync, writer_threads."""
        from eagle3.store.format import StoreSpec
        from eagle3.store.writer import ShardWriter

        e3 = self._e3
        mode = cfg["mode"] if e3["owner"] else "count"
        if e3["capturer"] is None:
            e3["capturer"] = Capturer(
                len(e3["ids"]),
                int(cfg["hidden_size"]),
                getattr(torch, cfg.get("dtype", "bfloat16")),
                slots=cfg.get("slots", 4),
            )
        writer = None
        if mode == "store":
            writer = ShardWriter(
                cfg["root"],
                StoreSpec.from_json(cfg["spec"]),
                cfg["start_index"],
                fsync=cfg["fsync"],
                threads=cfg.get("writer_threads", 2),
                writer_id=f"tp{e3['par']['tp_rank']} pid {os.getpid()}",
            )
        e3["writer"], e3["files_reported"] = writer, 0  # files_reported: how many of writer.written replies named
        e3["capturer"].start(
            mode,
            writer,
            shard_tokens=cfg.get("shard_tokens") or 8192,
            dtype=getattr(torch, cfg.get("dtype", "bfloat16")),
            copy_chunk_bytes=cfg.get("copy_chunk_bytes", COPY_CHUNK_BYTES),
            gil_sampler=bool(cfg.get("gil_sampler")),
            max_step_tokens=compat.max_step_tokens(self.model_runner),
            step_dtype=getattr(self.model_runner, "dtype", None),
        )
        return {"rank": e3["par"]["tp_rank"], "mode": mode}

    def eagle3_expect(self, sample_ids: list, lengths: list, ids: bytes, masks: bytes) -> dict:
        """Announce the next batch (capture.pack_announcement's four values)."""
        cap = self._e3["capturer"]
        if cap.filler is not None:
            cap.filler.announce(unpack_announcement(sample_ids, lengths, ids, masks))
        return {"rank": self._e3["par"]["tp_rank"], "announced": len(sample_ids)}

    def eagle3_collect(
        self,
        final: bool = False,
        seal: bool = False,
        announce: list | None = None,
        withdraw: list | None = None,
        wait: bool = True,
    ) -> dict:
        """After generate(): report the shards the writer has finished and any errors. By default it does not wait
        for the copies of the batch's last steps to reach the host: the next batch's prefill overlaps them
        (waiting here idled the GPU for one copy per batch). Samples matched, rows placed and tokens counted are
        known without waiting (they are settled inside the forward); a failed copy is reported by a later collect
        or by close. ``seal`` (online training): wait for the copies and close the open shard, so every sample of
        the batch is in a shard handed to the writer; with ``wait`` also wait for the writer (every sample in a
        reported shard), else report the shards finished so far (the next batch's prefill overlaps the write).
        ``final``: seal and wait, at the end of a session.
        ``announce`` (eagle3_expect's four values): the next batches, announced once these are collected, so the
        engine idles through one RPC between groups of batches, not two a batch. ``withdraw``: sample ids announced
        and never to be generated (a session that ended early), forgotten before the check that every announced
        sample was captured."""
        e3, cap = self._e3, self._e3["capturer"]
        whole = final or seal  # every sample announced so far must be in a shard handed to the writer
        if whole:
            cap.drain()
        errors = cap.take_errors()
        if cap.filler is not None:
            if withdraw:
                cap.filler.withdraw(withdraw)
            outstanding = cap.filler.outstanding()
            if outstanding:
                errors.append(f"{len(outstanding)} announced samples were not captured (e.g. {outstanding[:3]})")
                cap.filler.expected.clear()
            if cap.filler.where:
                errors.append(f"{len(cap.filler.where)} requests ended with rows missing")
                cap.filler.where.clear()
            cap.filler.done.clear()
        shards = []
        if e3["writer"] is not None:
            try:
                if whole:
                    cap.filler.seal()  # every copy has arrived (drained above): the shard goes to the writer now
                wait_all = final or (seal and wait)  # ... and in a reported one
                shards = [vars(i) for i in (e3["writer"].flush() if wait_all else e3["writer"].take_done())]
            except Exception as ex:  # noqa: BLE001 - a failed shard write is reported, not raised here
                errors.append(f"shard writer: {type(ex).__name__}: {ex}")
        if announce is not None:
            self.eagle3_expect(*announce)
        writer, new_files = e3["writer"], []
        if writer is not None:  # the files written since the last reply (the whole list grew with the session)
            new_files, e3["files_reported"] = writer.written[e3["files_reported"] :], len(writer.written)
        return {
            "rank": e3["par"]["tp_rank"],
            "owner": e3["owner"],
            "steps": cap.stats.steps,
            "tokens": cap.stats.tokens,
            "bytes_to_host": cap.stats.bytes_to_host,
            "completed": cap.filler.completed if cap.filler else 0,
            "shards": shards,
            "errors": errors,
            "recomputed": cap.filler.recomputed if cap.filler else 0,
            "writer": writer is not None,
            "files_written": new_files,
            "timing": cap.stats.timing(),
        }

    def eagle3_close(self, withdraw: list | None = None) -> dict:
        """Seal and write the open shard, wait for every write; returns the last shards. ``withdraw``: as collect's."""
        reply = self.eagle3_collect(final=True, withdraw=withdraw)
        self._e3["capturer"].stop()
        if self._e3["writer"] is not None:
            self._e3["writer"].close()
            self._e3["writer"] = None
        return reply

    def eagle3_end(self) -> dict:
        """End a session that did not close (its loop failed or was interrupted): the copies in flight land, the
        writer's threads end once the shards handed to them are written, the open shard is dropped (uncommitted: a
        rerun redoes its samples). After eagle3_close, or again: nothing more happens."""
        e3 = self._e3
        if e3["capturer"] is not None:
            e3["capturer"].stop()
        writer, e3["writer"] = e3["writer"], None
        if writer is not None:
            writer.close()
        return {"rank": e3["par"]["tp_rank"]}

    def eagle3_regen_open(self, cfg: dict) -> dict:
        """`extract --regenerate`: from now on every row each request computes (prompt rows at prefill, a row a
        decode step) is kept by position (decode_capture.RowCollector) until eagle3_regen_write names the sample it
        belongs to. cfg: root, spec, start_index, shard_tokens, fsync, writer_threads. The owner writes; other
        ranks count rows."""
        from eagle3.extract.decode_capture import RowCollector
        from eagle3.store.format import StoreSpec
        from eagle3.store.writer import ShardWriter

        e3 = self._e3
        e3["regen"] = RowCollector(keep=e3["owner"])
        e3["regen_writer"] = (
            ShardWriter(
                cfg["root"],
                StoreSpec.from_json(cfg["spec"]),
                cfg["start_index"],
                cfg["shard_tokens"],
                fsync=cfg["fsync"],
                threads=cfg.get("writer_threads", 2),
                writer_id=f"tp{e3['par']['tp_rank']} pid {os.getpid()}",
            )
            if e3["owner"]
            else None
        )
        return {"rank": e3["par"]["tp_rank"], "owner": e3["owner"]}

    def eagle3_regen_write(self, samples: list) -> dict:
        """samples: [(sample_id, [request ids in the order they ran], input ids as int32 bytes, loss mask as uint8
        bytes)]. The owner assembles each sample's rows and writes them, then cuts the shard: every sample of the
        call is in a reported shard. Returns the shards, the rows counted so far and any errors."""
        import numpy as np

        from eagle3.extract.capture import CaptureError

        e3 = self._e3
        rows, writer = e3["regen"], e3["regen_writer"]
        errors, shards = list(rows.errors), []
        rows.errors.clear()
        if writer is not None:
            try:
                for sid, names, ids, mask in samples:
                    ids_t = torch.from_numpy(np.frombuffer(ids, dtype=np.int32).copy())
                    mask_t = torch.from_numpy(np.frombuffer(mask, dtype=np.uint8).copy())
                    try:
                        states = rows.take(sid, names, len(ids_t))  # [T, n_layers, H]
                    except CaptureError as e:
                        errors.append(str(e))
                        continue
                    writer.add(sid, ids_t, mask_t, states.transpose(0, 1))
                shards = [vars(i) for i in writer.flush()]
            except Exception as ex:  # noqa: BLE001 - reported, not raised here
                errors.append(f"shard writer: {type(ex).__name__}: {ex}")
        return {
            "rank": e3["par"]["tp_rank"],
            "owner": e3["owner"],
            "steps": rows.steps,
            "rows": rows.rows,
            "shards": shards,
            "errors": errors,
        }

    def eagle3_regen_close(self) -> dict:
        """End the session: the writer's threads end; rows no sample claimed are dropped (and counted)."""
        e3 = self._e3
        rows, writer = e3.pop("regen", None), e3.pop("regen_writer", None)
        if writer is not None:
            writer.close()
        return {"rank": e3["par"]["tp_rank"], "unclaimed": rows.drop() if rows is not None else 0}

    def eagle3_dump_head(self, folder: str) -> dict:
        """Write this rank's slice of the target's final norm and lm_head to FOLDER/head-tp<rank>.safetensors
        (the self-check's head when the target has no checkpoint, e.g. load_format="dummy")."""
        from safetensors.torch import save_file

        norm, head, start, end = compat.final_head(compat.get_model(self))
        rank = self._e3["par"]["tp_rank"] if hasattr(self, "_e3") else compat.parallel_info()["tp_rank"]
        path = os.path.join(folder, f"head-tp{rank}.safetensors")
        save_file(
            {
                "norm": norm.detach().float().cpu().contiguous(),
                "lm_head": head[: end - start].detach().cpu().contiguous(),
            },
            path,
            metadata={"vocab_start": str(start), "vocab_end": str(end)},
        )
        return {"rank": rank, "file": path}

    def eagle3_unit_norms(self) -> dict:
        """Dummy-weight targets only: set every decoder layer's RMSNorm weight to 1. vLLM's dummy loader draws
        each parameter uniform in +-1e-3 from one seed per shape, so all layers share weights and norm weights of
        ~1e-3 shrink each layer's update far below the bf16 resolution of the residual: ids 2 and 30 of the
        kimi-depth profile came back equal to 1e-6. With unit norms each layer's update is a few percent.
        The final norm keeps its weights: with a unit weight RMSNorm is idempotent, and the self-check could not
        tell a post-norm state from the pre-norm one."""
        model = compat.get_model(self)
        final = compat.final_norm_module(model)
        n = 0
        with torch.no_grad():
            for module in model.modules():
                weight = getattr(module, "weight", None)
                if module is not final and "RMSNorm" in type(module).__name__ and isinstance(weight, torch.Tensor):
                    weight.fill_(1.0)
                    n += 1
        return {"norms": n}

    def eagle3_drafter_info(self, positions: list) -> dict:
        """Serving-side facts about the loaded EAGLE-3 draft: does it share the target's embedding and lm_head,
        its weights' dtype, and its rotary embedding (class, base, cos/sin at ``positions``) - what vLLM applies."""
        configure_worker_logging()
        info = compat.drafter_facts(self.model_runner, compat.get_model(self))
        rope = info.pop("rotary")
        cache = rope.cos_sin_cache
        half = cache.shape[-1] // 2
        info.update(
            rope_class=type(rope).__name__,
            rope_base=float(getattr(rope, "base", 0.0)),
            rope_cos=[cache[p, :half].float().tolist() for p in positions],
            rope_sin=[cache[p, half:].float().tolist() for p in positions],
        )
        return info

    def eagle3_set_aux_layers(self, layer_ids: list) -> dict:
        """Serving-side: change the target layers the EAGLE-3 drafter receives (eval's off-by-one check)."""
        configure_worker_logging()
        compat.set_aux_layers(compat.get_model(self), layer_ids)
        log.info("drafter now fed target layers %s", list(layer_ids))
        return {"layer_ids": list(layer_ids)}

    def eagle3_debug_layers(self, n_tokens: int) -> list:
        """The last step's first n_tokens rows of each captured layer, as tensors.

        What the original generator's ``_get_captured_states`` returned through collective_rpc; kept
        only so the GPU suite can show what such a reply looks like. Never used for data."""
        last = self._e3["last"] or []
        return [t[:n_tokens].detach().cpu() for t in last]
