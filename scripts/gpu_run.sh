# kvblend's GPU run, the whole of one device command: in the repository root with gpu_kit/
# beside it (scripts/gpu_kit.py), command limit 560 s. Phases (kvblend/bench/gpu_run.py),
# each with its own limit, ~490 s in all; after each, $OUT holds kvr.tgz (every log and
# result) and summary.md (partial until the last). P="tests": those phases only. D=cpu or
# --device cpu: the CPU smoke run. X: more options for the phases' bench or pytest; T: a limit.
set -u; [ "${1:-}" = --device ] && D=$2; D=${D:-cuda}; X=${X:-}
P=${P:-env llama-8b qwen tests compiled compiled-tests}
K=${K:-$PWD/gpu_kit}; O=${OUT:-/tmp/kvo}; R=${R:-/tmp/kvr}; PY=python3; rm -rf $R; mkdir -p $R $O
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 KVBLEND_COMPILE=0 PYTHONPATH=$PWD/src:$PWD/tests:$K/site
G="-m kvblend.bench.gpu_run"
for p in $P; do case $p in env) l=20;; llama-8b) l=140;; qwen) l=60;; tests) l=70;;
 compiled) l=90;; compiled-tests) l=80;; *) l=1;; esac; l=${T:-$l}; s=$SECONDS
 timeout -s INT -k 5 $l $PY $G $p --device $D --kit $K --out $R -- $X >$R/$p.log 2>&1
 echo "$p rc=$? $((SECONDS-s))s limit ${l}s" >>$R/phases.txt; tail -n 2 $R/$p.log
 rm -f $R/summary.md; $PY $G summary --device $D --out $R >$R/summary.log 2>&1
 { cat $R/summary.md || { cat $R/phases.txt; tail $R/summary.log; }; } >$O/summary.md 2>&1
 tar czf $O/kvr.tgz -C $R .; done; cat $O/summary.md
