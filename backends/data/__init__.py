"""Training data: JSONL or plain text, or the embedded synthetic addition task, packed into sequences.

- `tokenizers`: the model directory's tokenizer, else `ByteTokenizer` (ids are UTF-8 bytes).
- `examples`: reading files into `Example(prompt, completion)`s, tokenising and packing them.
- `addition`: the embedded default task and its held-out accuracy.
- `batches`: step k's microbatches from either source (`make_batches`).
"""
