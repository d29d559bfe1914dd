#!/usr/bin/env bash
# Regenerate docs/analysis: one report per zoo paper model and cluster profile over 1..64
# devices. Run from the repository root with the venv active. Models whose exact search
# took more than ~3 minutes on a shared 2-core machine use --epsilon 0.02 (listed below);
# each report's header states the mode and the guarantee. rnnlm runs only with
# INCLUDE_RNNLM=1: its exact search finishes every mesh but takes 18 (h100) and 35 (v100)
# minutes per profile on 2 cores (see README.md).
set -euo pipefail
models_dir=$(mktemp -d)
trap 'rm -rf "$models_dir"' EXIT
EPSILON_MODELS=" inception_v3-h100 "
models="mlp gpt bert vgg16 resnet50 inception_v3 wide_resnet"
if [[ "${INCLUDE_RNNLM:-0}" == 1 ]]; then models="$models rnnlm"; fi
for model in $models; do
  tensoropt model "$model" --preset paper -o "$models_dir/$model.onnx"
  for profile in v100 h100; do
    extra=()
    if [[ "$EPSILON_MODELS" == *" $model-$profile "* ]]; then extra=(--epsilon 0.02); fi
    tensoropt report "$models_dir/$model.onnx" --devices 1..64 --cluster "$profile" \
      "${extra[@]}" -o "docs/analysis/$model-$profile"
  done
done
