# Megatron SafePipe on an NGC PyTorch image (CUDA, NCCL, Transformer Engine, NVIDIA apex).
#
#   docker build -t megatron-safepipe .
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:24.07-py3 -t megatron-safepipe:24.07 .
#   docker run --gpus all --ipc=host -v /data:/data megatron-safepipe \
#       bash examples/gpt3_7b/train_gpt3_7b_pp2_vpp2.sh /data/ckpt /data/tb /data/corpus_text_document /data/tokenizer.model
#
# The default base is upstream Megatron-LM's long-term CI image (see README, "Docker"). torch,
# Transformer Engine and apex come from the base image and are left alone.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_NVLS_ENABLE=0 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace/megatron-safepipe

# The pure-python dependencies first (a layer that rarely changes); never torch from PyPI.
RUN pip install "sentencepiece>=0.2" "tokenizers>=0.19" "tensorboard>=2.14" "matplotlib>=3.8"

COPY setup.py pyproject.toml requirements.txt README.md LICENSE ./
COPY megatron ./megatron
COPY pretrain_gpt.py ./
COPY tools ./tools
COPY examples ./examples
COPY patches ./patches

# --no-deps: the base image's torch must stay (pip would otherwise consider replacing it).
RUN pip install --no-deps -e . \
    && python -c "import megatron.core, megatron.training.training"

CMD ["bash"]
