"""Datasets for GPT pretraining, under megatron-core 0.11 module names.

``indexed_dataset`` reads and writes the ``.bin``/``.idx`` pair that ``tools/preprocess_data.py``
produces; ``gpt_dataset`` cuts it into training samples; ``blended_dataset`` mixes several of
them; ``blended_megatron_dataset_builder`` makes the train/valid/test splits. Nothing is imported
here so that ``import megatron.core.datasets.indexed_dataset`` stays cheap.
"""
