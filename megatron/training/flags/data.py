"""Flags of the datasets and data loaders (the tokenizer's are beside the tokenizers)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.training.flags.schema import option, unavailable

_OTHER_MODELS = "BERT, T5 and retrieval datasets are not implemented"


@dataclasses.dataclass
class DataArgs:
    data_path: Optional[list[str]] = option(None, "dataset prefixes, optionally weighted: "
                                            "[w1] p1 [w2] p2 ...", nargs="*")
    split: Optional[str] = option(None, "train,valid,test proportions of --data-path (default "
                                  "969,30,1)")
    train_data_path: Optional[list[str]] = option(None, "dataset prefixes of the training "
                                                  "split, optionally weighted", nargs="*")
    valid_data_path: Optional[list[str]] = option(None, "dataset prefixes of the validation "
                                                  "split, optionally weighted", nargs="*")
    test_data_path: Optional[list[str]] = option(None, "dataset prefixes of the test split, "
                                                 "optionally weighted", nargs="*")
    data_args_path: Optional[str] = option(None, "a file holding the --data-path values "
                                           "(instead of --data-path)")
    per_split_data_args_path: Optional[str] = option(
        None, 'a JSON file {"train": [...], "valid": [...], "test": [...]} of the '
        "--train/valid/test-data-path values (instead of those flags)")
    data_cache_path: Optional[str] = option(None, "directory for cached dataset indices")
    mmap_bin_files: bool = option(True, "memory-map the .bin files (else read each sample "
                                  "from the file)", negative=("--no-mmap-bin-files",))
    mock_data: bool = option(False, "synthetic data instead of --data-path")
    seq_length: Optional[int] = option(None, "sequence length (the longest, with "
                                       "--variable-seq-lengths)")
    encoder_seq_length: Optional[int] = option(
        None, "for GPT the same as --seq-length (give one of the two)")
    decoder_seq_length: Optional[int] = unavailable(None, "encoder-decoder models (T5) are not "
                                                    "implemented")
    retriever_seq_length: int = unavailable(256, _OTHER_MODELS)
    sample_rate: float = unavailable(1.0, _OTHER_MODELS)
    mask_prob: float = unavailable(0.15, _OTHER_MODELS)
    short_seq_prob: float = unavailable(0.1, _OTHER_MODELS)
    num_workers: int = option(2, "data loader worker processes")
    reset_position_ids: bool = option(False, "restart position ids after each end of document")
    reset_attention_mask: bool = option(False, "no attention across end of document")
    eod_mask_loss: bool = option(False, "no loss on end-of-document tokens")
    create_attention_mask_in_dataloader: bool = option(
        True, "build attention masks in the data loader; only --reset-attention-mask's say more "
        "than the causal mask attention applies without one, so only those are built (turned "
        "off, --reset-attention-mask has no effect, as upstream)",
        negative=("--no-create-attention-mask-in-dataloader",))
    num_dataset_builder_threads: int = option(
        1, "threads building the datasets of a blend's prefixes")
    s3_cache_path: Optional[str] = unavailable(None, "datasets are read from local or mounted "
                                               "file systems only")
