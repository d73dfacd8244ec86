"""Stage 3, the shard store.

Shard store: safetensors shards of many samples + manifest.json, the commit point.

    STORE/manifest.json          schema, target identity, layer ids, convention, dtype, hidden size,
                                 committed shards (file, checksum, bytes, sample ids, tokens)
    STORE/plan.json              every sample id the extraction intends to write (for verify)
    STORE/shards/shard-NNNNNN.safetensors
        input_ids  int32 [N]        N = tokens in the shard
        loss_mask  uint8 [N]
        offsets    int64 [S + 1]    sample s = rows offsets[s]:offsets[s+1]
        hidden_states dtype [N, n_layers, H]   layers in the manifest's layer_ids order (as vLLM's
                                    extract_hidden_states lays them out: a token's layers are adjacent)
        header metadata: sample_ids (JSON), layer_ids, convention, dtype, hidden_size, target_config_hash,
                         writer (who wrote it, e.g. "tp0 pid 1234" for the vLLM owner rank)

Writes go to a temp name, are fsynced, then renamed; the manifest is rewritten the same way after the
shard files it names are durable. A shard file that the manifest does not name is not part of the store:
opening the store deletes it, and a resumed run writes those samples again. Only safetensors and JSON
are ever read: nothing in a store is unpickled.

format.py  the layout and spec; files.py  durable writes; writer.py  shards; folder.py  the store folder;
verify.py  `eagle3 verify`.
"""
