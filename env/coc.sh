# coc-inject: turn Communication-over-Computation on for Megatron jobs started from this shell.
#
#   source env/coc.sh          put the bootstrap on PYTHONPATH (CoC as the COC_* variables or the job's MindSpeed flags say)
#   source env/coc.sh 4        ... and chunked CoC with 4 chunks  (COC_PARALLEL_NUM=4 USE_COC_FUSED_KERNEL=0)
#   source env/coc.sh auto     ... and chunk counts tuned per shape (COC_PARALLEL_NUM=auto USE_COC_FUSED_KERNEL=0)
#   source env/coc.sh fused    ... and the fused kernel           (USE_COC_FUSED_KERNEL=1)
#   source env/coc.sh off      ... and the master switch off      (COC_DISABLE=1)
#
# Works from any directory, in bash and zsh. Sourcing it again never duplicates the
# PYTHONPATH entry. Nothing heavy happens in Python processes that never import Megatron.
# Note (bash): `source env/coc.sh` without arguments inside a script sees that script's
# own arguments; pass an explicit argument there, or none from an interactive shell.

if [ -n "${BASH_VERSION:-}" ]; then
    _coc_src="${BASH_SOURCE[0]}"
elif [ -n "${ZSH_VERSION:-}" ]; then
    eval '_coc_src="${(%):-%x}"'
else
    _coc_src="${0}"
fi

_coc_inject_env() {
    _coc_arg="${1:-}"
    _coc_site="$(CDPATH= cd -- "$(dirname -- "$_coc_src")/../sitecustomize" >/dev/null 2>&1 && pwd -P)"
    if [ -z "$_coc_site" ] || [ ! -f "$_coc_site/sitecustomize.py" ]; then
        printf '%s\n' "[coc-inject] error: cannot find the bootstrap directory next to $_coc_src" >&2
        return 1
    fi

    # Validate the argument before changing anything.
    case "$_coc_arg" in
        ""|fused|off|auto) ;;
        *[!0-9]*|0*)
            printf '%s\n' "[coc-inject] error: unknown argument '$_coc_arg'; allowed: a positive integer N (chunk count), 'auto', 'fused', 'off', or nothing" >&2
            return 1 ;;
    esac

    # PYTHONPATH: drop every copy of our directory, then put it first. Other entries,
    # empty ones included (they mean the current directory), are kept as they are.
    _coc_pp=":${PYTHONPATH:-}:"
    while :; do
        case "$_coc_pp" in
            *":$_coc_site:"*) _coc_pp="${_coc_pp%%:"$_coc_site":*}:${_coc_pp#*:"$_coc_site":}" ;;
            *) break ;;
        esac
    done
    _coc_pp="${_coc_pp#:}"
    _coc_pp="${_coc_pp%:}"
    export PYTHONPATH="$_coc_site${_coc_pp:+:$_coc_pp}"

    case "$_coc_arg" in
        "") ;;
        fused)
            export USE_COC_FUSED_KERNEL=1
            unset COC_DISABLE ;;
        off)
            export COC_DISABLE=1 ;;
        *)
            export COC_PARALLEL_NUM="$_coc_arg" USE_COC_FUSED_KERNEL=0
            unset COC_DISABLE ;;
    esac

    # Every COC_* / USE_COC_* variable set in the environment, every wing's (COC_MULTI_COPY, COC_CP_ALGO,
    # COC_MOE_OVERLAP, ...): a list of names here would miss the next wing's.
    _coc_vars=""
    for _coc_name in $(env | sed -n 's/^\(\(USE_\)\{0,1\}COC_[A-Za-z0-9_]*\)=.*/\1/p' | LC_ALL=C sort -u); do
        eval "_coc_set=\${$_coc_name+x}"
        if [ -n "$_coc_set" ]; then
            eval "_coc_val=\${$_coc_name}"
            _coc_vars="$_coc_vars $_coc_name=$_coc_val"
        fi
    done
    # Without variables the command line of the job can still turn CoC on (the MindSpeed flags).
    printf '%s\n' "[coc-inject] bootstrap on PYTHONPATH ($_coc_site);${_coc_vars:- no CoC variables set: CoC is off unless the job passes the MindSpeed flags --use-ascend-coc --coc-parallel-num N (or --coc-fused-kernel), which turn it on}" >&2
    return 0
}

_coc_inject_env "$@"
_coc_rc=$?
unset -f _coc_inject_env
unset _coc_src _coc_arg _coc_site _coc_pp _coc_vars _coc_name _coc_set _coc_val
eval "unset _coc_rc; return $_coc_rc"
