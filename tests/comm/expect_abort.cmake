# cmake -DCMD="mpiexec;-n;4;...;binary" -DEXPECT="regex;regex" -DMAX_SECONDS=N -P expect_abort.cmake
# Passes when the command exits non-zero, within MAX_SECONDS, and its output matches every regex.
# Open MPI 4.1's mpiexec at times never returns after an aborted job's ranks have ended (seen about
# once in a few hundred runs under load, with the abort message already printed). A job that does
# not end is therefore run once more, and only a second hang fails the test: a hang of dtrain's own
# abort path happens every time and still fails it.
function(run_job try out_rc out_all)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT ${MAX_SECONDS})
  string(TIMESTAMP t1 "%s")
  math(EXPR elapsed "${t1} - ${t0}")
  message("---- output of try ${try} (exit ${rc}, ${elapsed} s) ----\n${out}${err}\n----")
  set(${out_rc} "${rc}" PARENT_SCOPE)
  set(${out_all} "${out}${err}" PARENT_SCOPE)
endfunction()

run_job(1 rc all)
if(rc MATCHES "timeout|Process terminated")
  message("the job did not end within ${MAX_SECONDS} s; running it once more")
  run_job(2 rc all)
endif()
if(rc STREQUAL "0")
  message(FATAL_ERROR "expected a non-zero exit, got 0")
endif()
if(rc MATCHES "timeout|Process terminated")
  message(FATAL_ERROR "the job did not end within ${MAX_SECONDS} s, twice (${rc})")
endif()
foreach(re ${EXPECT})
  if(NOT all MATCHES "${re}")
    message(FATAL_ERROR "output does not match '${re}'")
  endif()
endforeach()
message("ok: exit ${rc}")
