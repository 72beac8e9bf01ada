/* A gloo worker thread that is slow to let go of a finished collective, as on a loaded machine (issue 24).

   cc -shared -fPIC -o slow_gloo_release.so slow_gloo_release.c -ldl
   LD_PRELOAD=./slow_gloo_release.so SLOW_GLOO_RELEASE_MS=10 torchrun ... user_shape_error.py

   torch's gloo worker (pt_gloo_runloop) runs each collective through ProcessGroupGloo::AsyncWork::execute,
   which libtorch_cpu calls through its PLT, and drops its reference to the Work after it returns. This
   definition runs torch's own and then sleeps: the rank's Python goes on (the collective is complete) while the
   worker still holds the Work, the window in which a process that exits at once used to abort. It says so on
   stderr the first time, so that a test notices when a torch build no longer reaches it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define EXECUTE                                                                                                 \
    "_ZN4c10d16ProcessGroupGloo9AsyncWork7executeERKN3c1013intrusive_ptrIS1_NS2_6detail34intrusive_target_" \
    "default_null_typeIS1_EEEE"

typedef void (*execute_fn)(void *);

void _ZN4c10d16ProcessGroupGloo9AsyncWork7executeERKN3c1013intrusive_ptrIS1_NS2_6detail34intrusive_target_default_null_typeIS1_EEEE(
    void *work) {
    static execute_fn torch_execute;
    static int announced;
    if (torch_execute == NULL) {
        /* libtorch_cpu is loaded without RTLD_GLOBAL: look the definition up in it, not after this library */
        void *library = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
        torch_execute = library ? (execute_fn)dlsym(library, EXECUTE) : NULL;
        if (torch_execute == NULL) {
            fprintf(stderr, "slow_gloo_release: torch's %s not found\n", EXECUTE);
            abort();
        }
    }
    torch_execute(work);
    const char *text = getenv("SLOW_GLOO_RELEASE_MS");
    long ms = text ? atol(text) : 10;
    if (!__atomic_exchange_n(&announced, 1, __ATOMIC_RELAXED)) {
        fprintf(stderr, "slow_gloo_release: gloo's worker keeps each finished Work %ld ms longer\n", ms);
    }
    struct timespec pause = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&pause, NULL);
}
