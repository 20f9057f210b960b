"""Training data: files, Hugging Face datasets or the embedded synthetic addition task, packed into sequences.

- `formats`: a file's format from its content (JSON Lines or array, CSV/TSV, Parquet, plain text), or a dataset id.
- `records`: a record's kind (text, prompt/completion, messages, ShareGPT, Alpaca) as an `Example`.
- `hubdata`: a Hugging Face dataset's split through `datasets` and the Hugging Face cache.
- `tokenizers`: the model directory's tokenizer, else `ByteTokenizer` (ids are UTF-8 bytes); `chatspans`: where
  each assistant turn lies in a chat template's rendering.
- `examples`: `Example(prompt, completion)`s tokenised and packed into windows.
- `addition`: the embedded default task and its held-out accuracy.
- `batches`: step k's microbatches from either source (`make_batches`); `summary`: what a run read.
"""
